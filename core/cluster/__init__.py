"""A cluster of ``specdec serve`` instances coordinated by Redis (docs/deployment.md).

Every instance registers itself in Redis with a heartbeat (:mod:`.registry`). Any instance's
OpenAI endpoint takes a request; its router (:mod:`.router`) runs it here or hands it to
another instance through that instance's job list in Redis, and the other instance streams the
request's events back through a Redis stream (:mod:`.remote`, :mod:`.runner`). With
``prefill`` and ``decode`` instances a request's prompt runs on a prefill instance, whose KV
blocks then travel over a direct TCP connection (:mod:`.transfer`) to a decode instance that
generates the rest. :class:`Cluster` (:mod:`.node`) ties these together for the server.
"""

import importlib

__all__ = ["Cluster", "ClusterOptions", "SchedulerConfig", "parse_scheduler_url"]
_HOMES = {"Cluster": ".node", "ClusterOptions": ".node", "SchedulerConfig": ".redis_link",
          "parse_scheduler_url": ".redis_link"}


def __getattr__(name: str):
    # Imported on first use: the node pulls in the HTTP server (FastAPI, 1-1.5 s), which
    # `specdec generate` and the CLI's flag parsing (.flags) never need.
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
