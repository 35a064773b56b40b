"""Where a request runs: here, on another instance, or split over a prefill and a decode one.

The rules, in order:

1. When the cluster has ``prefill`` and ``decode`` instances of this model (with the same KV
   layout), the request goes to the least loaded prefill instance, which hands it to the
   least loaded decode instance (disaggregation).
2. Otherwise it runs whole on the least loaded ``mixed`` instance, this one included.
3. With Redis unreachable, a mixed instance runs what it receives itself.

Load is ``num_pending / max_pending``: this instance's own as it is now, another's as last
registered plus the requests this instance has sent there since (registrations are up to a
second old; without that correction a burst of requests would all go to whichever instance
looked idlest). Ties go to this instance (no hop), then by id.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

import attrs

from .registry import InstanceInfo


@attrs.frozen
class Route:
    """``kind`` ``local`` (run it here), ``run`` (whole, on ``target``) or ``pd`` (prefill on
    ``target``, decode on ``decode``)."""

    kind: str
    target: Optional[InstanceInfo] = None
    decode: Optional[InstanceInfo] = None


class NoRoute(Exception):
    """No instance of the cluster can run the request now (the message says why)."""


class Router:
    """Chooses routes from this instance's :class:`~specdec.cluster.registry.ClusterView`."""

    def __init__(self, me: InstanceInfo):
        self.me = me
        self._sent: Counter = Counter()  # requests sent per instance since the last view update
        self._local_pending: Optional[int] = None

    def view_updated(self) -> None:
        """The registrations are fresh: they now count what was sent before."""
        self._sent.clear()

    def choose(self, instances: Iterable[InstanceInfo], exclude: frozenset = frozenset(),
               redis_down: bool = False, local_pending: Optional[int] = None) -> Route:
        """The route of one request; raises :class:`NoRoute`. ``exclude``: instances that
        already failed this request; ``local_pending``: this instance's requests in flight now."""
        self._local_pending = local_pending
        if redis_down:
            if self.me.role == "mixed":
                return Route("local")
            raise NoRoute("the cluster's Redis is unreachable, and this instance does not run whole requests "
                          f"(--role {self.me.role})")
        candidates = [i for i in instances if i.model == self.me.model and i.instance_id not in exclude]
        route = self._disaggregated(candidates) or self._whole(candidates)
        if route is None:
            roles = sorted({i.role for i in candidates}) or ["none"]
            raise NoRoute(f"no instance of the cluster can run this request now (instances up for model "
                          f"'{self.me.model}': {', '.join(roles)}; needs a mixed instance, or prefill and decode)")
        for instance in (route.target, route.decode):
            if instance is not None:
                self._sent[instance.instance_id] += 1
        return route

    def _disaggregated(self, candidates: list[InstanceInfo]) -> Optional[Route]:
        prefill = [i for i in candidates if i.role == "prefill"]
        decode = [i for i in candidates if i.role == "decode" and i.transfer]
        if not prefill or not decode:
            return None
        target = self._least_loaded(prefill)
        compatible = [i for i in decode if i.kv_layout == target.kv_layout]
        if not compatible:
            return None
        return Route("pd", target, self._least_loaded(compatible))

    def _whole(self, candidates: list[InstanceInfo]) -> Optional[Route]:
        mixed = [i for i in candidates if i.role == "mixed"]
        if not mixed:
            return None
        target = self._least_loaded(mixed)
        return Route("local") if target.instance_id == self.me.instance_id else Route("run", target)

    def _least_loaded(self, instances: list[InstanceInfo]) -> InstanceInfo:
        def key(info: InstanceInfo):
            if info.instance_id == self.me.instance_id and self._local_pending is not None:
                pending = self._local_pending
            else:
                pending = info.num_pending + self._sent[info.instance_id]
            load = pending / max(1, info.max_pending)
            return load, info.instance_id != self.me.instance_id, info.instance_id

        return min(instances, key=key)
