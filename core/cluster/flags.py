"""The scheduler flags: where the cluster's Redis is, and how to reach it.

Two spellings reach the same :class:`~specdec.cluster.redis_link.SchedulerConfig`:

* specdec's: ``--scheduler redis://HOST:PORT/DB`` (``rediss://`` for TLS);
* FastDeploy's, so that its cluster command lines work as written: ``--scheduler-name``
  ``global`` or ``splitwise`` with ``--scheduler-host``, ``--scheduler-port`` and
  ``--scheduler-db``. FastDeploy's ``local`` scheduler is serving alone; its ``dp`` scheduler
  (data-parallel ranks of one deployment) has no counterpart here and is refused by name.

Both take ``--scheduler-topic`` (the namespace of the cluster's keys), ``--scheduler-ttl``
(seconds a request's records outlive their last write, as FastDeploy's TTL of Redis keys), the
password (``--scheduler-password-file``, ``$SPECDEC_SCHEDULER_PASSWORD``, or
``--scheduler-password``, which :func:`argv_without_password` takes off the process's command
line) and ``--scheduler-ca-file`` (the CA of a TLS Redis).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from typing import Optional

from ..errors import SpecdecError
from .redis_link import DEFAULT_RECORDS_TTL_S, DEFAULT_TOPIC, SchedulerConfig, parse_scheduler_url, redacted

#: The environment variable that holds Redis's password.
PASSWORD_ENV = "SPECDEC_SCHEDULER_PASSWORD"
#: FastDeploy's ``--scheduler-name`` values: what each means here (None: refused).
SCHEDULER_NAMES = {
    "local": "serve alone (no Redis)",
    "global": "join the Redis cluster",
    "splitwise": "join the Redis cluster",
    "dp": None,
}
_FASTDEPLOY_ADDRESS = ("scheduler_host", "scheduler_port", "scheduler_db")


def add_scheduler_flags(group, fastdeploy: bool = True) -> None:
    """The scheduler flags (``fastdeploy``: with FastDeploy's ``--scheduler-name`` and address
    flags too, as ``specdec serve`` has them)."""
    group.add_argument("--scheduler-topic", default=None, metavar="NAME",
                       help=f"the cluster's namespace in Redis: clusters of different topics share one Redis "
                            f"without seeing each other (default {DEFAULT_TOPIC})")
    group.add_argument("--scheduler-password-file", default=None, metavar="PATH",
                       help=f"a file whose first line is Redis's password (default: ${PASSWORD_ENV})")
    group.add_argument("--scheduler-ca-file", default=None, metavar="PATH",
                       help="a PEM file of the CA that signed a rediss:// (TLS) Redis's certificate "
                            "(default: the system's CAs)")
    if not fastdeploy:
        return
    group.add_argument("--scheduler-password", default=None, metavar="PASSWORD",
                       help=f"Redis's password itself (FastDeploy's flag; taken off the command line at start, "
                            f"but prefer --scheduler-password-file or ${PASSWORD_ENV})")
    group.add_argument("--scheduler-ttl", type=int, default=None, metavar="SECONDS",
                       help=f"how long a remote request's records outlive their last write in Redis "
                            f"(default {DEFAULT_RECORDS_TTL_S})")
    group.add_argument("--scheduler-name", default=None, metavar="NAME",
                       help="FastDeploy's scheduler: global or splitwise (join the cluster at --scheduler-host), "
                            "local (serve alone); the same as --scheduler")
    group.add_argument("--scheduler-host", default=None, metavar="HOST",
                       help="with --scheduler-name global/splitwise: Redis's host (default 127.0.0.1)")
    group.add_argument("--scheduler-port", type=int, default=None, metavar="PORT",
                       help="with --scheduler-name global/splitwise: Redis's port (default 6379)")
    group.add_argument("--scheduler-db", type=int, default=None, metavar="DB",
                       help="with --scheduler-name global/splitwise: Redis's database (default 0)")


def scheduler_url(args: argparse.Namespace) -> Optional[str]:
    """The Redis URL of the flags: ``--scheduler``, or built from FastDeploy's; None to serve
    alone. A one-line :class:`SpecdecError` for flags that contradict each other."""
    name = getattr(args, "scheduler_name", None)
    address = [f"--{flag.replace('_', '-')}" for flag in _FASTDEPLOY_ADDRESS if getattr(args, flag, None) is not None]
    if name is None:
        if address:
            raise SpecdecError(f"{address[0]}: needs --scheduler-name global or splitwise (FastDeploy's default "
                               "scheduler, local, has no Redis), or give --scheduler redis://HOST:PORT/DB")
        return args.scheduler
    if name not in SCHEDULER_NAMES:
        raise SpecdecError(f"--scheduler-name: must be one of {', '.join(SCHEDULER_NAMES)}, got '{name}'")
    if SCHEDULER_NAMES[name] is None:
        raise SpecdecError("--scheduler-name dp: FastDeploy's data-parallel scheduler has no counterpart in specdec; "
                           "run one instance per data-parallel rank with --scheduler-name global")
    if name == "local":
        given = ["--scheduler"] * (args.scheduler is not None) + address
        if given:
            raise SpecdecError(f"{given[0]}: --scheduler-name local serves alone, without Redis; use global or "
                               "splitwise to join a cluster")
        return None
    if args.scheduler is not None:
        if address:
            raise SpecdecError(f"{address[0]}: give Redis's address once, with --scheduler or with "
                               "--scheduler-host/--scheduler-port/--scheduler-db")
        return args.scheduler
    host = args.scheduler_host or "127.0.0.1"
    port = 6379 if args.scheduler_port is None else args.scheduler_port
    db = 0 if args.scheduler_db is None else args.scheduler_db
    if not 0 < port < 65536:
        raise SpecdecError(f"--scheduler-port: must be between 1 and 65535, got {port}")
    if db < 0:
        raise SpecdecError(f"--scheduler-db: must be >= 0, got {db}")
    shown_host = f"[{host}]" if ":" in host else host
    return f"redis://{shown_host}:{port}/{db}"


def scheduler_config(args: argparse.Namespace) -> Optional[SchedulerConfig]:
    """The :class:`SchedulerConfig` of the flags (None: serve alone); one-line
    :class:`SpecdecError` naming the flag for bad input, never showing the password."""
    url = scheduler_url(args)
    options = {"topic": args.scheduler_topic, "ca_file": args.scheduler_ca_file,
               "records_ttl_s": getattr(args, "scheduler_ttl", None)}
    if url is None:
        others = [flag for flag, value in (("--scheduler-topic", args.scheduler_topic),
                                           ("--scheduler-ca-file", args.scheduler_ca_file),
                                           ("--scheduler-password", getattr(args, "scheduler_password", None)),
                                           ("--scheduler-password-file", args.scheduler_password_file))
                  if value is not None]
        if others:
            raise SpecdecError(f"{others[0]}: needs a cluster (--scheduler, or --scheduler-name global/splitwise)")
        return None
    parse_scheduler_url(url)
    password = _password(args, url_has_one=urllib.parse.urlsplit(url).password is not None)
    return SchedulerConfig.from_flags(url, password, **{k: v for k, v in options.items() if v is not None})


def _password(args: argparse.Namespace, url_has_one: bool) -> Optional[str]:
    """Redis's password: from the file, the flag or the URL (at most one of them), else from
    ``$SPECDEC_SCHEDULER_PASSWORD``; None when there is none."""
    given = [flag for flag, present in (("--scheduler-password-file", args.scheduler_password_file is not None),
                                        ("--scheduler-password", getattr(args, "scheduler_password", None) is not None),
                                        ("--scheduler", url_has_one)) if present]
    if len(given) > 1:
        raise SpecdecError(f"{given[1]}: Redis's password is given by {given[0]} already; give it once")
    if args.scheduler_password_file is not None:
        try:
            with open(args.scheduler_password_file, encoding="utf-8") as handle:
                return handle.readline().strip() or None
        except OSError as exc:
            raise SpecdecError(f"--scheduler-password-file: cannot read {args.scheduler_password_file}: "
                               f"{exc.strerror or exc}") from None
    if given:
        return getattr(args, "scheduler_password", None)  # None for the URL's: the URL carries it
    return os.environ.get(PASSWORD_ENV) or None


def argv_without_password(argv: list[str], args: argparse.Namespace) -> Optional[list[str]]:
    """``argv`` with Redis's password taken out (``--scheduler-password VALUE`` dropped, a
    password in ``--scheduler``'s URL removed), or None when it holds none. The command line
    re-executes itself with it, the password in ``$SPECDEC_SCHEDULER_PASSWORD`` (only the
    process's user can read its environment; anyone can read its command line)."""
    flag_password = getattr(args, "scheduler_password", None)
    url = getattr(args, "scheduler", None)
    url_password = url is not None and urllib.parse.urlsplit(url).password is not None
    if flag_password is None and not url_password:
        return None
    kept, skip_next = [], False
    for index, token in enumerate(argv):
        if skip_next:
            skip_next = False
            continue
        name, has_value, _ = token.partition("=")
        if flag_password is not None and len(name) > len("--scheduler-pa") and "--scheduler-password".startswith(name):
            skip_next = not has_value and index + 1 < len(argv) and argv[index + 1] == flag_password
            continue
        if url_password and token == url:
            token = redacted(url)
        elif url_password and has_value and token.endswith("=" + url):
            token = f"{name}={redacted(url)}"
        kept.append(token)
    return kept


def hide_password_and_restart(argv: list[str], args: argparse.Namespace) -> None:
    """When ``argv`` (this process's command line, ``sys.orig_argv``: the interpreter first) holds
    Redis's password,
    start this command again without it, the password in ``$SPECDEC_SCHEDULER_PASSWORD`` (does
    not return); otherwise return."""
    kept = argv_without_password(argv, args)
    if kept is None or getattr(args, "scheduler_password_file", None) is not None:
        return  # nothing to hide, or a password given twice: the command's own check says so
    password = args.scheduler_password
    if password is None:
        password = urllib.parse.unquote(urllib.parse.urlsplit(args.scheduler).password or "")
    print("notice: Redis's password: taken off the command line (ps showed it); pass it with "
          f"--scheduler-password-file or ${PASSWORD_ENV} instead", file=sys.stderr, flush=True)
    os.environ[PASSWORD_ENV] = password
    os.execv(sys.executable, [sys.executable, *kept[1:]])
