"""Who is in the cluster: each instance's registration, renewed by a heartbeat.

An instance writes its :class:`InstanceInfo` under ``TOPIC:instance:<id>`` every
:data:`HEARTBEAT_S` seconds with a time to live of :data:`TTL_S`: an instance that dies, or
loses Redis, drops out of the cluster within ``TTL_S`` seconds. :class:`ClusterView` is an
instance's picture of the others, refreshed by the same heartbeat; it tells an instance as
dead only when Redis itself has been reachable for ``TTL_S`` seconds (right after Redis
restarts, nobody is registered yet, and that is no proof of anyone's death).

Whoever can write to Redis can write a registration, so every reader checks each one alone
(:func:`parse_registration`) and skips a bad one (:mod:`.records`): one that is not JSON, lacks
a field or has one of the wrong type or out of bounds, lives without a time to live (or longer
than ``TTL_S``), or, when the cluster has a secret, is not signed with it for its own key. A
forged registration that claims ``num_pending: -1000`` and never expires would otherwise take
every request and answer none.
"""

from __future__ import annotations

import json
import math
import time
from typing import Iterable, Optional

import attrs
from attrs import validators as check

from .records import BadRecord
from .redis_link import RedisLink
from .secret import BadSignature, seal, unseal

#: Seconds between two registrations of an instance.
HEARTBEAT_S = 1.0
#: Seconds a registration lives without a heartbeat.
TTL_S = 3.0
#: The roles of ``--role``.
ROLES = ("mixed", "prefill", "decode")
#: How far apart the clocks of two instances may be: a registration whose heartbeat is older than
#: ``TTL_S`` plus this is a stale copy (a replay), not a live instance.
MAX_CLOCK_SKEW_S = 30.0
#: The largest registration read, in bytes.
MAX_RECORD_BYTES = 64 * 1024
#: The bound of every count (requests, KV blocks) in a registration.
MAX_COUNT = 10**9


def _count(low: int = 0):
    return [check.instance_of(int), check.ge(low), check.le(MAX_COUNT), _not_bool]


def _not_bool(_, attribute, value) -> None:
    if isinstance(value, bool):  # True is an int to Python, not to a registration
        raise TypeError(f"'{attribute.name}' must be an integer, got a boolean")


def _text(limit: int):
    return [check.instance_of(str), check.max_len(limit)]


def _time(_, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"'{attribute.name}' must be a time (seconds since 1970)")


def _transfer(_, attribute, value) -> None:
    host, _, port = value.rpartition(":")
    if value and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"'{attribute.name}' must be empty or HOST:PORT")


@attrs.define(slots=True, kw_only=True)
class InstanceInfo:
    """One instance, as it registers itself. Every field is checked (type and bounds) when an
    ``InstanceInfo`` is made, so that a registration read from Redis is either sane or skipped.

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

    instance_id: str = attrs.field(validator=[*_text(256), check.min_len(1)])
    role: str = attrs.field(validator=check.in_(ROLES))
    model: str = attrs.field(validator=_text(256))
    url: str = attrs.field(validator=[*_text(2048), check.matches_re(r"https?://\S+")])
    transfer: str = attrs.field(default="", validator=[*_text(300), _transfer])
    num_pending: int = attrs.field(default=0, validator=_count())
    max_pending: int = attrs.field(default=1, validator=_count(1))
    num_free_kv_blocks: int = attrs.field(default=0, validator=_count())
    num_kv_blocks: int = attrs.field(default=0, validator=_count())
    needs_hidden_states: bool = attrs.field(default=False, validator=check.instance_of(bool))
    kv_layout: dict = attrs.field(factory=dict, validator=check.instance_of(dict))
    method: str = attrs.field(default="", validator=_text(64))
    pid: int = attrs.field(default=0, validator=_count())
    started_at: float = attrs.field(default=0.0, validator=_time)
    heartbeat_at: float = attrs.field(default=0.0, validator=_time)

    @property
    def load(self) -> float:
        """The share of its capacity in use."""
        return self.num_pending / max(1, self.max_pending)

    @classmethod
    def from_dict(cls, fields: dict) -> "InstanceInfo":
        """From a registration's fields (unknown ones ignored, for newer versions); raises
        :class:`~specdec.cluster.records.BadRecord` for a missing, mistyped or out-of-bounds one."""
        known = {f.name for f in attrs.fields(cls)}
        try:
            return cls(**{k: v for k, v in fields.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise BadRecord("field", _field_problem(exc)) from None


def _field_problem(exc: Exception) -> str:
    """The first line of an attrs validator's message, without the value (an attacker's text)."""
    if isinstance(exc, TypeError) and exc.args and isinstance(exc.args[0], str) and "missing" in exc.args[0]:
        return exc.args[0].replace("InstanceInfo.__init__() ", "")
    text = str(exc.args[0]) if exc.args else str(exc)
    return text.split(" (got ")[0].split(", got ")[0][:200]


def _kind(key: str) -> str:
    """What a registration's MAC covers besides its body: its key (topic and instance id), so
    that a signed registration moved to another key, or another topic, no longer checks out."""
    return f"registration {key}"


def parse_registration(key: str, value: bytes, pttl_ms: int, secret: Optional[bytes],
                       now: Optional[float] = None) -> InstanceInfo:
    """The :class:`InstanceInfo` of the registration ``value`` read under ``key`` (with
    ``pttl_ms``, its time to live in ms as ``PTTL`` answers); raises
    :class:`~specdec.cluster.records.BadRecord` saying why it is skipped."""
    if pttl_ms < 0 or pttl_ms > TTL_S * 1000:
        raise BadRecord("expiry", "no time to live" if pttl_ms < 0 else f"a time to live of {pttl_ms} ms "
                        f"(registrations live {TTL_S:g} s)")
    if len(value) > MAX_RECORD_BYTES:
        raise BadRecord("malformed", f"{len(value)} bytes (at most {MAX_RECORD_BYTES})")
    try:
        fields = unseal(secret, _kind(key), value)
    except BadSignature as exc:
        raise BadRecord("signature", str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise BadRecord("malformed", f"not a JSON object ({type(exc).__name__})") from None
    if secret is None and isinstance(fields.get("p"), str) and "mac" in fields:
        fields = _unverified_payload(fields["p"])  # a signed record, read without the secret
    info = InstanceInfo.from_dict(fields)
    if not key.endswith(f":instance:{info.instance_id}"):
        raise BadRecord("field", f"its instance_id '{info.instance_id[:64]}' is not its key's")
    age = (time.time() if now is None else now) - info.heartbeat_at
    if age > TTL_S + MAX_CLOCK_SKEW_S:
        raise BadRecord("expiry", f"its heartbeat is {age:.0f} s old (a stale copy, or the clocks differ)")
    return info


def _unverified_payload(body: str) -> dict:
    try:
        fields = json.loads(body)
    except ValueError:
        raise BadRecord("malformed", "a signed record whose body is not JSON") from None
    if not isinstance(fields, dict):
        raise BadRecord("malformed", "a signed record whose body is not a JSON object")
    return fields


async def register(link: RedisLink, info: InstanceInfo, secret: Optional[bytes] = None) -> None:
    """Write ``info`` with the registration's time to live, signed when the cluster has a secret."""
    info.heartbeat_at = time.time()
    key = link.keys.instance(info.instance_id)
    record = seal(secret, _kind(key), attrs.asdict(info))
    await link.call(lambda: link.client.set(key, record, px=int(TTL_S * 1000)))


async def deregister(link: RedisLink, instance_id: str) -> None:
    """Leave the cluster now (a graceful stop), rather than when the registration expires."""
    await link.call(lambda: link.client.delete(link.keys.instance(instance_id)), give_up_after=2.0)


async def read_instances(link: RedisLink, secret: Optional[bytes] = None) -> list[InstanceInfo]:
    """Every instance registered with a sane registration (signed, when the cluster has a
    secret), by id; the others are skipped and reported to ``link.bad_records``."""
    async def scan() -> list[tuple[bytes, Optional[bytes], int]]:
        keys = [key async for key in link.client.scan_iter(match=link.keys.instance_pattern, count=1000)]
        if not keys:
            return []
        async with link.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
                pipe.pttl(key)
            answers = await pipe.execute()
        return [(key, answers[2 * i], answers[2 * i + 1]) for i, key in enumerate(keys)]

    infos = []
    now = time.time()
    for raw_key, value, pttl_ms in await link.call(scan):
        if value is None:  # expired between the scan and the read
            continue
        key = raw_key.decode(errors="replace")
        try:
            infos.append(parse_registration(key, value, pttl_ms, secret, now))
        except BadRecord as problem:
            link.bad_records.report("registration", key, value, problem)
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
