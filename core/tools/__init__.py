"""Tools for a plugin's own commands that run an engine (training a model-based proposer, say).

They sit above the engine, so a plugin imports them only inside the command that uses them;
``import specdec.sdk`` and importing a plugin never load them.

- :func:`load_plugins`: the installed plugins' registries, fresh (to add a proposer of the
  tool's own before building an engine);
- :class:`HiddenStateRecorder`, :class:`RecordedSequence`, :func:`save_recorded`,
  :func:`load_recorded`: the target's hidden states and argmax at every position of a text,
  the data model-based proposers are trained on.
"""

from ..plugin_manager import load_plugins
from .recording import HiddenStateRecorder, RecordedSequence, load_recorded, save_recorded

__all__ = ["load_plugins", "HiddenStateRecorder", "RecordedSequence", "save_recorded", "load_recorded"]
