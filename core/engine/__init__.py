"""The engine: requests, the step loop, and the outputs it produces."""

from .engine import Engine
from .request import Request, RequestOutput

__all__ = ["Engine", "Request", "RequestOutput"]
