"""The connection to the cluster's Redis, and the names of everything the cluster keeps there.

Redis may restart, or be unreachable for a while: every call here retries on a connection
error until it succeeds or ``give_up_after`` seconds have passed, and :attr:`RedisLink.run_id`
(Redis's own id of the server process, new at each start) tells the rest of the cluster when
Redis came back empty-handed, so that they can re-register and check what they were waiting for.

Where Redis is and how to reach it is a :class:`SchedulerConfig`: the URL (``redis://`` or,
with TLS, ``rediss://``), the password (kept apart from the URL, so that no message or log
line shows it), the CA file that vouches for a TLS server, and the topic: the namespace of
every key, so that several clusters can share one Redis.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.parse
from typing import Awaitable, Callable, Optional, TypeVar

import attrs

from ..errors import SpecdecError
from .records import BadRecords

logger = logging.getLogger("specdec.cluster")
T = TypeVar("T")

#: The topic of a cluster that names none: every key starts with ``specdec:``.
DEFAULT_TOPIC = "specdec"
#: Seconds a remote request's event stream stays in Redis after its last event (``--scheduler-ttl``).
DEFAULT_RECORDS_TTL_S = 300
#: The bounds of ``--scheduler-ttl``: long enough for a slow client to read a request's events, and
#: short enough that abandoned streams do not pile up.
RECORDS_TTL_BOUNDS_S = (10, 7 * 24 * 3600)
_TOPIC = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SCHEMES = ("redis", "rediss")


def redacted(url: str) -> str:
    """``url`` without its password (or user), for logs and messages; robust to URLs that do not
    parse (everything between ``//`` and the last ``@`` goes)."""
    return re.sub(r"//.*@", "//", url, flags=re.DOTALL)


def parse_scheduler_url(url: str) -> str:
    """Check ``--scheduler``: ``redis://[:PASSWORD@]HOST:PORT[/DB]`` or ``rediss://...`` (TLS);
    returns it unchanged, or raises a one-line :class:`SpecdecError` that never shows the password."""
    parsed = urllib.parse.urlsplit(url)
    problem = None
    if parsed.scheme not in _SCHEMES:
        problem = "the scheme must be redis:// or rediss:// (TLS)"
    elif not parsed.hostname:
        problem = "no host"
    else:
        try:
            parsed.port  # noqa: B018 - raises on a bad port
        except ValueError:
            problem = "bad port"
        db = parsed.path.strip("/")
        if db and not db.isdigit():
            problem = "the database must be a number"
    if problem or "\n" in url:
        problem = problem or "a line break"
        raise SpecdecError(f"--scheduler: expected redis://HOST:PORT/DB or rediss://HOST:PORT/DB, got "
                           f"'{redacted(url)}' ({problem})")
    return url


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Where the cluster's Redis is, how to reach it, and the cluster's namespace in it.

    :ivar url: ``redis://HOST:PORT/DB`` or ``rediss://HOST:PORT/DB`` (TLS), without a password
        (:meth:`from_flags` moves one given in the URL into :attr:`password`).
    :ivar password: Redis's password (``requirepass``), or None; never part of a message.
    :ivar ca_file: a PEM file of the CA that signed the TLS server's certificate (``rediss://``
        only; default: the system's CAs).
    :ivar topic: the namespace of every key (``TOPIC:instance:<id>``, ...): clusters of different
        topics share one Redis without seeing each other.
    :ivar records_ttl_s: seconds a remote request's event stream outlives its last event.
    """

    url: str
    password: Optional[str] = attrs.field(default=None, repr=False)
    ca_file: Optional[str] = None
    topic: str = DEFAULT_TOPIC
    records_ttl_s: int = DEFAULT_RECORDS_TTL_S

    @classmethod
    def from_flags(cls, url: str, password: Optional[str] = None, **options) -> "SchedulerConfig":
        """Check every setting (one-line :class:`SpecdecError` naming the flag); a password in
        ``url`` moves to :attr:`password` (giving it twice is an error)."""
        parse_scheduler_url(url)
        parsed = urllib.parse.urlsplit(url)
        if parsed.password is not None or parsed.username:
            if password is not None:
                raise SpecdecError("--scheduler: the URL has a password, and one is given apart too; give it once")
            password = urllib.parse.unquote(parsed.password or "") or None
            url = redacted(url)
        config = cls(url=url, password=password, **options)
        if not _TOPIC.fullmatch(config.topic):
            raise SpecdecError(f"--scheduler-topic: 1 to 64 letters, digits, '_', '.' or '-', got '{config.topic}'")
        low, high = RECORDS_TTL_BOUNDS_S
        if not low <= config.records_ttl_s <= high:
            raise SpecdecError(f"--scheduler-ttl: must be between {low} and {high} seconds, got {config.records_ttl_s}")
        if config.ca_file is not None and not config.is_tls:
            raise SpecdecError("--scheduler-ca-file: needs a rediss:// (TLS) scheduler")
        return config

    @property
    def is_tls(self) -> bool:
        return self.url.startswith("rediss://")

    @property
    def shown(self) -> str:
        """How messages name this Redis (the URL, and the topic when it is not the default)."""
        return self.url if self.topic == DEFAULT_TOPIC else f"{self.url} (topic {self.topic})"

    def client_options(self) -> dict:
        """What ``redis.Redis.from_url`` takes besides the URL (both clients, sync and async)."""
        options: dict = {"password": self.password}
        if self.ca_file is not None:
            options["ssl_ca_certs"] = self.ca_file
        return options

    @property
    def keys(self) -> "Keys":
        return Keys(self.topic)


class Keys:
    """Key names under one topic (one place, so that the layout is documented and greppable).

    The topic has no ``:`` (:class:`SchedulerConfig` checks), so no key of one topic is ever a
    key, or matches a pattern, of another."""

    def __init__(self, topic: str = DEFAULT_TOPIC):
        self.prefix = f"{topic}:"

    def instance(self, instance_id: str) -> str:
        """The instance's registration (JSON, signed with the cluster secret), expiring unless its
        heartbeat renews it."""
        return f"{self.prefix}instance:{instance_id}"

    @property
    def instance_pattern(self) -> str:
        """The SCAN pattern of every registration."""
        return f"{self.prefix}instance:*"

    def instance_id_of(self, key: bytes) -> str:
        """The instance id a registration's key names."""
        return key.decode(errors="replace")[len(self.instance("")):]

    def jobs(self, instance_id: str) -> str:
        """The list of jobs (JSON) waiting for that instance."""
        return f"{self.prefix}jobs:{instance_id}"

    def events(self, request_id: str) -> str:
        """The stream of a remote request's events, read by the instance the client is on."""
        return f"{self.prefix}events:{request_id}"

    def claim(self, request_id: str) -> str:
        """``INSTANCE ATTEMPT`` of whoever runs the request now, renewed while it runs."""
        return f"{self.prefix}claim:{request_id}"

    def taken(self, run_id: str) -> str:
        """Set (``SET NX``) by the instance that takes a job's run id: a job is run once."""
        return f"{self.prefix}taken:{run_id}"

    def cancel(self, request_id: str, attempt: int) -> str:
        """Set when the instance the client is on gives up on that attempt."""
        return f"{self.prefix}cancel:{request_id}:{attempt}"


class RedisUnavailable(SpecdecError):
    """Redis did not answer for longer than the caller was willing to wait."""


class RedisLink:
    """One ``redis.asyncio`` client for the whole instance, with retries and the restart check.

    :param config: where Redis is (:class:`SchedulerConfig`).
    :param give_up_after: seconds a call keeps retrying while Redis is unreachable.

    :attr:`keys` names the keys of the cluster's topic; :attr:`bad_records` counts and logs the
    records read from Redis that were skipped (malformed, unsigned, out of bounds).
    """

    def __init__(self, config: SchedulerConfig, give_up_after: float = 30.0):
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.asyncio.retry import Retry

        self.config = config
        self.keys = config.keys
        self.records_ttl_s = config.records_ttl_s
        self.bad_records = BadRecords()
        self.give_up_after = give_up_after
        self.client = aioredis.Redis.from_url(config.url, decode_responses=False, socket_timeout=5.0,
                                              socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 0),
                                              **config.client_options())
        #: Redis's run id when last seen; None before the first contact.
        self.run_id: Optional[str] = None
        #: When Redis last came back (or was first reached), in ``time.monotonic()`` seconds.
        self.reachable_since = time.monotonic()
        self.reconnects = 0
        self._down_since: Optional[float] = None

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    async def call(self, make: Callable[[], Awaitable[T]], give_up_after: Optional[float] = None) -> T:
        """``await make()``, retried every 0.2 s while Redis is unreachable; raises
        :class:`RedisUnavailable` after ``give_up_after`` seconds (default: the link's)."""
        import redis.exceptions as errors

        limit = self.give_up_after if give_up_after is None else give_up_after
        started = time.monotonic()
        while True:
            try:
                result = await make()
            except (errors.ConnectionError, errors.TimeoutError, OSError) as exc:
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    logger.warning("redis %s unreachable: %s", self.config.shown, exc)
                if time.monotonic() - started > limit:
                    raise RedisUnavailable(f"the cluster's Redis ({self.config.shown}) has not answered for "
                                           f"{limit:.0f} s") from None
                await asyncio.sleep(0.2)
                continue
            if self._down_since is not None:
                self._down_since = None
                self.reachable_since = time.monotonic()
                self.reconnects += 1
                logger.warning("redis %s reachable again", self.config.shown)
            return result

    async def check_run_id(self) -> bool:
        """Read Redis's run id; True when it changed since the last read (Redis restarted)."""
        info = await self.call(lambda: self.client.info("server"))
        run_id = info.get("run_id")
        changed = self.run_id is not None and run_id != self.run_id
        if changed:
            logger.warning("redis %s restarted (run id %s, was %s)", self.config.shown, run_id, self.run_id)
            self.reachable_since = time.monotonic()
        self.run_id = run_id
        return changed

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass


def ping(config: SchedulerConfig, timeout: float = 5.0) -> None:
    """Reach Redis once (synchronously); a one-line :class:`SpecdecError` if it does not answer
    within ``timeout`` seconds, refuses the password, or its TLS certificate does not check out."""
    import redis

    client = redis.Redis.from_url(config.url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                  **config.client_options())
    try:
        client.ping()
    except redis.exceptions.AuthenticationError as exc:
        if config.password is None:
            raise SpecdecError(f"--scheduler: {config.url} needs a password: --scheduler-password-file PATH or "
                               "$SPECDEC_SCHEDULER_PASSWORD") from None
        raise SpecdecError(f"--scheduler: {config.url} refused the password: {_one_line(exc)}") from None
    except (redis.exceptions.RedisError, OSError) as exc:
        raise SpecdecError(f"--scheduler: cannot reach {config.url}: {_one_line(exc)}") from None
    finally:
        client.close()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
