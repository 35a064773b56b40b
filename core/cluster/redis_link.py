"""The connection to the cluster's Redis, and the names of everything the cluster keeps there.

Redis may restart, or be unreachable for a while: every call here retries on a connection
error until it succeeds or ``give_up_after`` seconds have passed, and :attr:`RedisLink.run_id`
(Redis's own id of the server process, new at each start) tells the rest of the cluster when
Redis came back empty-handed, so that they can re-register and check what they were waiting for.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from typing import Awaitable, Callable, Optional, TypeVar

from ..errors import SpecdecError

logger = logging.getLogger("specdec.cluster")
T = TypeVar("T")

#: Every key the cluster writes starts with this.
PREFIX = "specdec:"


def parse_scheduler_url(url: str) -> str:
    """Check ``--scheduler``: ``redis://[:PASSWORD@]HOST:PORT[/DB]``; returns it unchanged, or
    raises a one-line :class:`SpecdecError`."""
    parsed = urllib.parse.urlsplit(url)
    problem = None
    if parsed.scheme != "redis":
        problem = "the scheme must be redis://"
    elif not parsed.hostname:
        problem = "no host"
    else:
        try:
            parsed.port  # noqa: B018 - raises on a bad port
        except ValueError:
            problem = "bad port"
        db = parsed.path.strip("/")
        if db and not db.isdigit():
            problem = f"the database must be a number, got '{db}'"
    if problem:
        raise SpecdecError(f"--scheduler: expected redis://HOST:PORT/DB, got '{url}' ({problem})")
    return url


def redacted(url: str) -> str:
    """``url`` without its password, for logs and messages."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.password is None:
        return url
    netloc = f"{parsed.hostname}:{parsed.port}" if parsed.port else str(parsed.hostname)
    return urllib.parse.urlunsplit(parsed._replace(netloc=netloc))


class Keys:
    """Key names (one place, so that the layout is documented and greppable)."""

    @staticmethod
    def instance(instance_id: str) -> str:
        """The instance's registration (JSON), expiring unless its heartbeat renews it."""
        return f"{PREFIX}instance:{instance_id}"

    INSTANCE_PATTERN = f"{PREFIX}instance:*"

    @staticmethod
    def jobs(instance_id: str) -> str:
        """The list of jobs (JSON) waiting for that instance."""
        return f"{PREFIX}jobs:{instance_id}"

    @staticmethod
    def events(request_id: str) -> str:
        """The stream of a remote request's events, read by the instance the client is on."""
        return f"{PREFIX}events:{request_id}"

    @staticmethod
    def claim(request_id: str) -> str:
        """``INSTANCE ATTEMPT`` of whoever runs the request now, renewed while it runs."""
        return f"{PREFIX}claim:{request_id}"

    @staticmethod
    def taken(run_id: str) -> str:
        """Set (``SET NX``) by the instance that takes a job's run id: a job is run once."""
        return f"{PREFIX}taken:{run_id}"

    @staticmethod
    def cancel(request_id: str, attempt: int) -> str:
        """Set when the instance the client is on gives up on that attempt."""
        return f"{PREFIX}cancel:{request_id}:{attempt}"


class RedisUnavailable(SpecdecError):
    """Redis did not answer for longer than the caller was willing to wait."""


class RedisLink:
    """One ``redis.asyncio`` client for the whole instance, with retries and the restart check.

    :param url: ``redis://HOST:PORT/DB``.
    :param give_up_after: seconds a call keeps retrying while Redis is unreachable.
    """

    def __init__(self, url: str, give_up_after: float = 30.0):
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.give_up_after = give_up_after
        self.client = aioredis.Redis.from_url(url, decode_responses=False, socket_timeout=5.0,
                                              socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 0))
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
                    logger.warning("redis %s unreachable: %s", redacted(self.url), exc)
                if time.monotonic() - started > limit:
                    raise RedisUnavailable(f"the cluster's Redis ({redacted(self.url)}) has not answered for "
                                           f"{limit:.0f} s") from None
                await asyncio.sleep(0.2)
                continue
            if self._down_since is not None:
                self._down_since = None
                self.reachable_since = time.monotonic()
                self.reconnects += 1
                logger.warning("redis %s reachable again", redacted(self.url))
            return result

    async def check_run_id(self) -> bool:
        """Read Redis's run id; True when it changed since the last read (Redis restarted)."""
        info = await self.call(lambda: self.client.info("server"))
        run_id = info.get("run_id")
        changed = self.run_id is not None and run_id != self.run_id
        if changed:
            logger.warning("redis %s restarted (run id %s, was %s)", redacted(self.url), run_id, self.run_id)
            self.reachable_since = time.monotonic()
        self.run_id = run_id
        return changed

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass


def ping(url: str, timeout: float = 5.0) -> None:
    """Reach Redis at ``url`` once (synchronously); a one-line :class:`SpecdecError` if it does
    not answer within ``timeout`` seconds."""
    import redis

    parse_scheduler_url(url)
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
    except redis.exceptions.AuthenticationError as exc:
        raise SpecdecError(f"--scheduler: {redacted(url)} refused the password: {exc}") from None
    except (redis.exceptions.RedisError, OSError) as exc:
        raise SpecdecError(f"--scheduler: cannot reach {redacted(url)}: {' '.join(str(exc).split())}") from None
    finally:
        client.close()
