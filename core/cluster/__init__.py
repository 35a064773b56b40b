"""A cluster of ``specdec serve`` instances coordinated by Redis (docs/deployment.md).

Every instance registers itself in Redis with a heartbeat (:mod:`.registry`). Any instance's
OpenAI endpoint takes a request; its router (:mod:`.router`) runs it here or hands it to
another instance through that instance's job list in Redis, and the other instance streams the
request's events back through a Redis stream (:mod:`.remote`, :mod:`.runner`). With
``prefill`` and ``decode`` instances a request's prompt runs on a prefill instance, whose KV
blocks then travel over a direct TCP connection (:mod:`.transfer`) to a decode instance that
generates the rest. :class:`Cluster` (:mod:`.node`) ties these together for the server.
"""

from .node import Cluster, ClusterOptions
from .redis_link import SchedulerConfig, parse_scheduler_url

__all__ = ["Cluster", "ClusterOptions", "SchedulerConfig", "parse_scheduler_url"]
