"""The OpenAI-compatible HTTP server (``specdec serve``).

- :mod:`~specdec.server.engine_loop`: one background thread owns the engine and runs continuous
  batching; requests go in through a thread-safe queue, their text comes back through asyncio
  queues.
- :mod:`~specdec.server.protocol`: the request and response models (pydantic), and how a request
  becomes ``SamplingParams``.
- :mod:`~specdec.server.responses`: a request's events as OpenAI responses, whole or streamed.
- :mod:`~specdec.server.errors`: the OpenAI error schema.
- :mod:`~specdec.server.metrics`: the Prometheus metrics.
- :mod:`~specdec.server.limits`: the server's limits (request bodies, prompt length, connections,
  the read timeout against slow and half-open connections).
- :mod:`~specdec.server.app`: the FastAPI app (``build_app``).
- :mod:`~specdec.server.serve`: running it with uvicorn, as ``specdec serve`` does.

docs/server.md documents the endpoints, fields, errors and metrics.
"""

from .app import build_app
from .engine_loop import EngineLoop, QueueFull
from .limits import ServerLimits

__all__ = ["EngineLoop", "QueueFull", "ServerLimits", "build_app"]
