"""The engine: requests, the step loop, and the outputs it produces."""

from .engine import Engine
from .handoff import HandoffState, KVLayout
from .request import Request, RequestOutput

__all__ = ["Engine", "HandoffState", "KVLayout", "Request", "RequestOutput"]
