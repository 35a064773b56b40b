"""Deprecated home of the hidden-state recorder: use :mod:`specdec.tools` (kept for one release)."""

import warnings

from .tools.recording import HiddenStateRecorder, RecordedSequence, load_recorded, save_recorded

warnings.warn("specdec.recording moved to specdec.tools; this alias goes in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["HiddenStateRecorder", "RecordedSequence", "save_recorded", "load_recorded"]
