"""The cluster's parts that need neither Redis nor a model: routing, the scheduler URL, the
event encoding, and the KV transfer listener's handling of good and bad messages."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from specdec.cluster.messages import decode_event, encode_event, to_loop_event
from specdec.cluster.records import BadRecord, BadRecords
from specdec.cluster.redis_link import parse_scheduler_url, redacted
from specdec.cluster.registry import InstanceInfo, parse_registration
from specdec.cluster.secret import seal
from specdec.cluster.router import NoRoute, Router
from specdec.cluster.transfer import MAGIC, TransferError, TransferServer, send_handoff
from specdec.engine.handoff import HandoffState, KVLayout
from specdec.errors import SpecdecError
from specdec.metrics import SpecMetrics
from specdec.sampling import SamplingParams
from specdec.server.engine_loop import Admitted, Delta, Finished, Rejected

LAYOUT = {"backend": "cpu", "dtype": "float16", "block_size": 16}


def _instance(name: str, role: str = "mixed", pending: int = 0, model: str = "m", layout=None) -> InstanceInfo:
    return InstanceInfo(instance_id=name, role=role, model=model, url=f"http://{name}", max_pending=100,
                        num_pending=pending, transfer=f"{name}:1" if role == "decode" else "",
                        kv_layout=layout if layout is not None else LAYOUT)


# -- routing -----------------------------------------------------------------------------------


def test_a_burst_of_requests_alternates_between_two_idle_instances():
    me, other = _instance("a"), _instance("b")
    router = Router(me)
    kinds, pending_here = [], 0
    for _ in range(6):  # faster than the heartbeat: the other's registration stays at 0 pending
        route = router.choose([me, other], local_pending=pending_here)
        pending_here += route.kind == "local"
        kinds.append(route.kind)
    assert kinds == ["local", "run"] * 3  # a tie goes to this instance (no hop), then they alternate
    router.view_updated()  # a fresh registration counts what was sent before
    assert router.choose([me, other], local_pending=pending_here).kind == "run"


def test_the_least_loaded_instance_gets_the_request_and_the_model_must_match():
    me = _instance("a")
    busy, idle, other_model = _instance("b", pending=50), _instance("c", pending=1), _instance("d", model="x")
    route = Router(me).choose([me, busy, idle, other_model], local_pending=10)
    assert route.kind == "run" and route.target.instance_id == "c"


def test_prefill_and_decode_instances_take_precedence_with_the_same_layout_only():
    me = _instance("a")
    prefill, decode = _instance("p", "prefill"), _instance("d", "decode")
    route = Router(me).choose([me, prefill, decode], local_pending=0)
    assert (route.kind, route.target.instance_id, route.decode.instance_id) == ("pd", "p", "d")
    other_layout = _instance("d", "decode", layout={**LAYOUT, "block_size": 32})
    assert Router(me).choose([me, prefill, other_layout], local_pending=0).kind == "local"


def test_excluded_instances_are_skipped_and_no_route_says_why():
    me = _instance("p", "prefill")
    decode = _instance("d", "decode")
    with pytest.raises(NoRoute, match="needs a mixed instance, or prefill and decode"):
        Router(me).choose([me, decode], exclude=frozenset({"d"}))
    with pytest.raises(NoRoute, match="Redis is unreachable"):
        Router(me).choose([me, decode], redis_down=True)
    assert Router(_instance("m")).choose([], redis_down=True).kind == "local"


# -- the scheduler URL and events --------------------------------------------------------------


@pytest.mark.parametrize("url, problem", [
    ("http://h:1/0", "scheme"), ("redis://:1/0", "no host"), ("redis://h:99999/0", "bad port"),
    ("redis://h:1/zero", "must be a number"),
])
def test_a_bad_scheduler_url_is_one_line(url, problem):
    with pytest.raises(SpecdecError, match=problem) as info:
        parse_scheduler_url(url)
    assert "\n" not in str(info.value)


def test_a_password_never_shows_in_messages():
    assert redacted("redis://:secret@host:6379/0") == "redis://host:6379/0"
    assert parse_scheduler_url("redis://:secret@host:6379/2") == "redis://:secret@host:6379/2"


@pytest.mark.parametrize("event", [
    Admitted(12), Rejected("prompt: too long", "prompt", "context_length_exceeded"), Delta("héllo", 3),
    Finished("!", 4, 12, "stop", SpecMetrics(2, 1, 3, 2, 4, [1, 1]), None),
    Finished("", 0, 12, "error", SpecMetrics(), "instance b stopped"),
])
def test_events_survive_the_stream_encoding(event):
    fields = encode_event(event, attempt=2, seq=7)
    data = decode_event({key.encode(): value.encode() for key, value in fields.items()})
    assert (data["attempt"], data["seq"]) == (2, 7)
    assert to_loop_event(data) == event


# -- the KV transfer listener --------------------------------------------------------------------


def _state(num_positions: int = 20, block_size: int = 16) -> HandoffState:
    blocks = -(-num_positions // block_size)
    rng = np.random.default_rng(1)
    layout = KVLayout(backend="cpu", dtype="float16", block_size=block_size, num_layers=2, num_kv_heads=1,
                      head_dim=8, model="m", vocab_size=100)
    return HandoffState(request_id="r", prompt_token_ids=np.arange(num_positions, dtype=np.int64),
                        output_token_ids=np.array([5], dtype=np.int64), sampling=SamplingParams(max_tokens=9),
                        rng_state=np.random.default_rng(3).bit_generator.state, num_positions=num_positions,
                        kv=[rng.standard_normal((blocks, 2, block_size, 8)).astype(np.float16) for _ in range(2)],
                        hidden_states=None, layout=layout, first_token_s=0.25)


async def _with_server(handler, check, max_bytes: int = 2**20, api_key=None):
    server = TransferServer("127.0.0.1", 0, handler, max_bytes, api_key)
    _, port = await server.start()
    try:
        return await check(f"127.0.0.1:{port}")
    finally:
        await server.close()


def test_a_hand_off_arrives_whole():
    received = []

    async def handler(meta, state):
        received.append((meta, state))
        return None

    sent = _state()
    stats = asyncio.run(_with_server(handler, lambda address: send_handoff(address, {"request_id": "r"}, sent)))
    assert stats.num_bytes == sum(layer.nbytes for layer in sent.kv)
    [(meta, state)] = received
    assert meta == {"request_id": "r"}
    assert state.layout == sent.layout and state.sampling == sent.sampling
    for got, want in zip(state.kv, sent.kv):
        np.testing.assert_array_equal(got, want)


def test_the_handler_refusal_reaches_the_sender():
    async def handler(meta, state):
        return "instance d: at capacity"

    with pytest.raises(TransferError, match="at capacity"):
        asyncio.run(_with_server(handler, lambda address: send_handoff(address, {}, _state())))


def test_oversized_and_unauthenticated_hand_offs_are_refused():
    async def handler(meta, state):  # pragma: no cover - never reached
        raise AssertionError("a refused hand-off reached the engine")

    with pytest.raises(TransferError, match="more than this instance's pool holds"):
        asyncio.run(_with_server(handler, lambda address: send_handoff(address, {}, _state()), max_bytes=100))
    with pytest.raises(TransferError, match="cluster key"):
        asyncio.run(_with_server(handler, lambda address: send_handoff(address, {}, _state(), api_key="wrong"),
                                 api_key="right"))


@pytest.mark.parametrize("payload, error", [
    (b"GET / HTTP/1.1\r\n\r\n", "bad magic"),
    (MAGIC + (2**40).to_bytes(8, "big"), "header of"),
    (MAGIC + (5).to_bytes(8, "big") + b"{nope", "bad hand-off"),
    (MAGIC + (50).to_bytes(8, "big") + b"{}", "closed the connection mid-message"),
])
def test_garbage_gets_an_error_answer_and_the_listener_goes_on(payload, error):
    async def handler(meta, state):
        return None

    async def check(address):
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(payload)
        if error.startswith("closed"):
            writer.write_eof()
        await writer.drain()
        answer = json.loads(await reader.readline())
        writer.close()
        # the listener still takes a good hand-off afterwards
        stats = await send_handoff(address, {}, _state())
        return answer, stats

    answer, stats = asyncio.run(_with_server(handler, check))
    assert answer["ok"] is False and error in answer["error"]
    assert stats.num_bytes > 0


# -- registrations read from Redis -------------------------------------------------------------

SECRET = b"0123456789abcdef0123456789abcdef"


def _record(**fields) -> dict:
    record = {"instance_id": "a", "role": "mixed", "model": "m", "url": "http://a:1", "num_pending": 0,
              "max_pending": 8, "heartbeat_at": time.time()}
    record.update(fields)
    return record


def _reason(key: str, value: bytes, pttl_ms: int = 2500, secret=SECRET) -> str:
    with pytest.raises(BadRecord) as info:
        parse_registration(key, value, pttl_ms, secret)
    assert "\n" not in str(info.value)
    return info.value.reason


def test_a_signed_sane_registration_is_read():
    key = "specdec:instance:a"
    info = parse_registration(key, seal(SECRET, f"registration {key}", _record(num_pending=3)), 2500, SECRET)
    assert (info.instance_id, info.num_pending) == ("a", 3)
    unsigned = parse_registration(key, json.dumps(_record()).encode(), 2500, None)  # a cluster without a secret
    assert unsigned.instance_id == "a"


@pytest.mark.parametrize("fields", [
    {"num_pending": "x"}, {"num_pending": -1000}, {"num_pending": True}, {"max_pending": 0},
    {"num_kv_blocks": 10**12}, {"role": "boss"}, {"url": "ftp://a"}, {"transfer": "nowhere"},
    {"heartbeat_at": float("nan")}, {"kv_layout": []}, {"instance_id": "b"},
])
def test_a_registration_with_a_mistyped_or_out_of_bounds_field_is_skipped(fields):
    key = "specdec:instance:a"
    assert _reason(key, seal(SECRET, f"registration {key}", _record(**fields))) == "field"
    assert _reason(key, json.dumps(_record(**fields)).encode(), secret=None) == "field"


def test_a_registration_missing_a_field_is_skipped():
    record = _record()
    del record["url"]
    assert _reason("specdec:instance:a", json.dumps(record).encode(), secret=None) == "field"


def test_unsigned_malformed_undying_and_replayed_registrations_are_skipped():
    key = "specdec:instance:a"
    assert _reason(key, b"\xff{not json") == "malformed"
    assert _reason(key, b"[1, 2]", secret=None) == "malformed"
    assert _reason(key, json.dumps(_record()).encode()) == "signature"  # unsigned, the cluster has a secret
    signed = seal(SECRET, f"registration {key}", _record())
    assert _reason("specdec:instance:b", signed) == "signature"  # moved to another instance's key
    assert _reason("other:instance:a", signed) == "signature"  # or to another topic
    assert _reason(key, signed, pttl_ms=-1) == "expiry"  # no time to live: never dies
    assert _reason(key, signed, pttl_ms=3_600_000) == "expiry"
    stale = seal(SECRET, f"registration {key}", _record(heartbeat_at=time.time() - 3600))
    assert _reason(key, stale) == "expiry"  # a copy of an old registration


def test_each_bad_record_is_counted_and_logged_once(caplog):
    records, counted = BadRecords(), []
    records.on_count = lambda kind, reason: counted.append((kind, reason))
    problem = BadRecord("malformed", "not a JSON object")
    with caplog.at_level("WARNING", logger="specdec.cluster"):
        for _ in range(5):  # five heartbeats read the same record
            records.report("registration", "specdec:instance:x", b"junk", problem)
        records.report("registration", "specdec:instance:x", b"other junk", problem)
    assert counted == [("registration", "malformed")] * 2
    assert len([r for r in caplog.records if "specdec:instance:x" in r.getMessage()]) == 2


# -- the scheduler flags -----------------------------------------------------------------------


def _scheduler(*flags: str):
    from specdec.cli import build_parser
    from specdec.cluster.flags import scheduler_config

    return scheduler_config(build_parser().parse_args(["serve", *flags]))


def test_fastdeploys_pd_command_line_means_a_cluster_under_its_topic(monkeypatch):
    monkeypatch.delenv("SPECDEC_SCHEDULER_PASSWORD", raising=False)
    config = _scheduler("--splitwise-role", "prefill", "--scheduler-name", "splitwise", "--scheduler-host",
                        "127.0.0.1", "--scheduler-port", "6379", "--scheduler-ttl", "9000", "--scheduler-topic",
                        "mtp", "--scheduler-password", "scheduler_mtp", "--metrics-port", "8181")
    assert (config.url, config.password, config.topic, config.records_ttl_s) == (
        "redis://127.0.0.1:6379/0", "scheduler_mtp", "mtp", 9000)
    assert config.keys.instance("p") == "mtp:instance:p" and config.keys.jobs("p") == "mtp:jobs:p"
    assert _scheduler("--scheduler-name", "global").url == "redis://127.0.0.1:6379/0"
    assert _scheduler("--scheduler-name", "local") is None
    assert _scheduler("--scheduler", "redis://h:1/0").keys.instance("p") == "specdec:instance:p"


@pytest.mark.parametrize("flags, message", [
    (["--scheduler-name", "dp"], "--scheduler-name dp: FastDeploy's data-parallel scheduler has no counterpart"),
    (["--scheduler-name", "grand"], "--scheduler-name: must be one of local, global, splitwise, dp"),
    (["--scheduler-host", "h"], "--scheduler-host: needs --scheduler-name global or splitwise"),
    (["--scheduler-name", "local", "--scheduler-port", "1"], "--scheduler-port: --scheduler-name local serves alone"),
    (["--scheduler-name", "global", "--scheduler", "redis://h:1/0", "--scheduler-host", "h"],
     "--scheduler-host: give Redis's address once"),
    (["--scheduler", "redis://:pw@h:1/0", "--scheduler-password", "pw"], "--scheduler: Redis's password is given"),
    (["--scheduler-topic", "t"], "--scheduler-topic: needs a cluster"),
    (["--scheduler", "redis://h:1/0", "--scheduler-topic", "a:b"], "--scheduler-topic: 1 to 64 letters"),
    (["--scheduler", "redis://h:1/0", "--scheduler-ttl", "0"], "--scheduler-ttl: must be between"),
    (["--scheduler", "redis://h:1/0", "--scheduler-ca-file", "ca.pem"], "--scheduler-ca-file: needs a rediss://"),
])
def test_contradictory_scheduler_flags_are_one_line_naming_the_flag(flags, message):
    with pytest.raises(SpecdecError) as info:
        _scheduler(*flags)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_password_leaves_the_url_the_environment_and_the_command_line(monkeypatch, tmp_path):
    from specdec.cli import build_parser
    from specdec.cluster.flags import argv_without_password

    monkeypatch.setenv("SPECDEC_SCHEDULER_PASSWORD", "from-env")
    config = _scheduler("--scheduler", "rediss://:s%40cret@h:1/2")
    assert (config.url, config.password, config.is_tls) == ("rediss://h:1/2", "s@cret", True)
    assert "cret" not in repr(config)
    assert _scheduler("--scheduler", "redis://h:1/0").password == "from-env"
    (tmp_path / "password").write_text("from-file\n")
    assert _scheduler("--scheduler", "redis://h:1/0", "--scheduler-password-file",
                      str(tmp_path / "password")).password == "from-file"
    argv = ["serve", "--scheduler", "redis://:pw@h:1/0", "--scheduler-password", "pw", "--port", "0"]
    args = build_parser().parse_args(argv[:3] + argv[5:])
    assert argv_without_password(["python", *argv[:3], *argv[5:]], args) == [
        "python", "serve", "--scheduler", "redis://h:1/0", "--port", "0"]
    args = build_parser().parse_args(["serve", "--scheduler-password=pw", "--scheduler-name", "global"])
    assert argv_without_password(["specdec", "serve", "--scheduler-password=pw", "--scheduler-name", "global"],
                                 args) == ["specdec", "serve", "--scheduler-name", "global"]


@pytest.mark.parametrize("url", ["redis://:hunter2@h:99999/0", "http://:hunter2@h:1/0", "redis://:hun/ter2@h:1/0",
                                 "redis://user:hunter2@h:1/db"])
def test_a_bad_scheduler_url_never_shows_its_password(url):
    with pytest.raises(SpecdecError) as info:
        parse_scheduler_url(url)
    assert "hunter2" not in str(info.value) and "ter2" not in str(info.value)
