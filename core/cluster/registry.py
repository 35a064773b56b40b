"""Who is in the cluster: each instance's registration, renewed by a heartbeat.

An instance writes its :class:`InstanceInfo` under ``specdec:instance:<id>`` every
:data:`HEARTBEAT_S` seconds with a time to live of :data:`TTL_S`: an instance that dies, or
loses Redis, drops out of the cluster within ``TTL_S`` seconds. :class:`ClusterView` is an
instance's picture of the others, refreshed by the same heartbeat; it tells an instance as
dead only when Redis itself has been reachable for ``TTL_S`` seconds (right after Redis
restarts, nobody is registered yet, and that is no proof of anyone's death).
"""

from __future__ import annotations

import json
import time
from typing import Iterable, Optional

import attrs

from .redis_link import Keys, RedisLink

#: Seconds between two registrations of an instance.
HEARTBEAT_S = 1.0
#: Seconds a registration lives without a heartbeat.
TTL_S = 3.0
#: The roles of ``--role``.
ROLES = ("mixed", "prefill", "decode")


@attrs.define(slots=True, kw_only=True)
class InstanceInfo:
    """One instance, as it registers itself.

    :ivar instance_id: unique in the cluster (``--instance-id``, default ``HOST:PORT``).
    :ivar role: ``mixed`` (runs whole requests), ``prefill`` or ``decode``.
    :ivar model: the served model name; requests only go to instances of the same name.
    :ivar url: the instance's OpenAI endpoint, ``http://HOST:PORT``.
    :ivar transfer: ``HOST:PORT`` of its KV transfer listener (decode and mixed instances).
    :ivar num_pending: requests in its engine loop (local and remote ones).
    :ivar max_pending: its ``--max-pending-requests``.
    :ivar num_free_kv_blocks: free blocks of its KV pool; ``num_kv_blocks`` the pool's size.
    :ivar needs_hidden_states: its proposer reads the target's hidden states (``mtp``): a
        prefill instance handing a request to it sends them along with the KV blocks.
    :ivar kv_layout: its KV cache layout (``KVLayout.to_dict()``); a prefill instance only
        hands requests to decode instances of the same layout.
    :ivar method: its speculative method (for ``specdec cluster status``).
    :ivar started_at, heartbeat_at: Unix times.
    """

    instance_id: str
    role: str
    model: str
    url: str
    transfer: str = ""
    num_pending: int = 0
    max_pending: int = 1
    num_free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    needs_hidden_states: bool = False
    kv_layout: dict = attrs.field(factory=dict)
    method: str = ""
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0

    @property
    def load(self) -> float:
        """The share of its capacity in use."""
        return self.num_pending / max(1, self.max_pending)

    def to_json(self) -> bytes:
        return json.dumps(attrs.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "InstanceInfo":
        fields = json.loads(data)
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})


async def register(link: RedisLink, info: InstanceInfo) -> None:
    """Write ``info`` with the registration's time to live."""
    info.heartbeat_at = time.time()
    await link.call(lambda: link.client.set(Keys.instance(info.instance_id), info.to_json(), px=int(TTL_S * 1000)))


async def deregister(link: RedisLink, instance_id: str) -> None:
    """Leave the cluster now (a graceful stop), rather than when the registration expires."""
    await link.call(lambda: link.client.delete(Keys.instance(instance_id)), give_up_after=2.0)


async def read_instances(link: RedisLink) -> list[InstanceInfo]:
    """Every registered instance, by id."""
    async def scan() -> list[bytes]:
        keys = [key async for key in link.client.scan_iter(match=Keys.INSTANCE_PATTERN, count=1000)]
        return await link.client.mget(keys) if keys else []

    values = await link.call(scan)
    infos = [InstanceInfo.from_json(value) for value in values if value]
    return sorted(infos, key=lambda info: info.instance_id)


class ClusterView:
    """This instance's last reading of the registry, with the time each instance was last seen."""

    def __init__(self, link: RedisLink):
        self.link = link
        self.instances: dict[str, InstanceInfo] = {}
        self._last_seen: dict[str, float] = {}

    def update(self, infos: Iterable[InstanceInfo]) -> None:
        now = time.monotonic()
        self.instances = {info.instance_id: info for info in infos}
        for instance_id in self.instances:
            self._last_seen[instance_id] = now

    def live(self) -> list[InstanceInfo]:
        """The instances registered at the last reading."""
        return list(self.instances.values())

    def get(self, instance_id: str) -> Optional[InstanceInfo]:
        return self.instances.get(instance_id)

    def is_dead(self, instance_id: str) -> bool:
        """True when ``instance_id`` has not been registered for ``TTL_S`` seconds while Redis
        was reachable (its heartbeat stopped: the process died, or lost Redis)."""
        now = time.monotonic()
        if self.link.is_down or now - self.link.reachable_since < TTL_S + HEARTBEAT_S:
            return False
        last_seen = self._last_seen.get(instance_id, self.link.reachable_since)
        return instance_id not in self.instances and now - max(last_seen, self.link.reachable_since) > TTL_S
