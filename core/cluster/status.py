"""``specdec cluster status``: the cluster as Redis knows it, one line per instance."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Optional

import attrs

from .redis_link import RedisLink, RedisUnavailable, SchedulerConfig, ping
from .registry import InstanceInfo, read_instances
from ..errors import SpecdecError


async def _read(config: SchedulerConfig, cluster_secret: Optional[bytes]) -> tuple[list[InstanceInfo], int]:
    link = RedisLink(config, give_up_after=5.0)
    try:
        return await read_instances(link, cluster_secret), sum(link.bad_records.counts.values())
    except RedisUnavailable as exc:
        raise SpecdecError(str(exc)) from None
    finally:
        await link.close()


def cluster_status(config: SchedulerConfig, output: str = "text", stream=None,
                   cluster_secret: Optional[bytes] = None) -> int:
    """Print the registered instances (``output`` ``text`` or ``json``); returns the exit code.
    With ``cluster_secret`` only signed registrations are listed; bad ones (malformed, out of
    bounds, unsigned) are counted, never listed."""
    stream = stream or sys.stdout
    ping(config)
    instances, num_bad = asyncio.run(_read(config, cluster_secret))
    if output == "json":
        print(json.dumps({"scheduler": config.url, "topic": config.topic, "bad_registrations": num_bad,
                          "instances": [attrs.asdict(i) for i in instances]}, indent=2), file=stream)
        return 0
    now = time.time()
    rows = [("INSTANCE", "ROLE", "MODEL", "METHOD", "URL", "KV TRANSFER", "PENDING", "LOAD", "FREE KV BLOCKS",
             "SEEN")]
    for i in instances:
        rows.append((i.instance_id, i.role, i.model, i.method, i.url, i.transfer or "-",
                     f"{i.num_pending}/{i.max_pending}", f"{i.load:.0%}",
                     f"{i.num_free_kv_blocks}/{i.num_kv_blocks}", f"{max(0.0, now - i.heartbeat_at):.1f}s ago"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip(), file=stream)
    roles = {role: sum(i.role == role for i in instances) for role in ("mixed", "prefill", "decode")}
    pending = sum(i.num_pending for i in instances)
    bad = f"; {num_bad} bad registrations skipped (see the instances' logs)" if num_bad else ""
    print(f"{len(instances)} instances ({', '.join(f'{n} {r}' for r, n in roles.items())}), "
          f"{pending} requests in flight; scheduler {config.shown}{bad}", file=stream)
    return 0
