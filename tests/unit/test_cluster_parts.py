"""The cluster's parts that need neither Redis nor a model: routing, the scheduler URL, the
event encoding, and the KV transfer listener's handling of good, bad and hostile messages
(over real sockets)."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import time

import numpy as np
import pytest

from specdec.cluster.messages import MAX_GRAMMAR_BYTES, Options, decode_event, encode_event, to_loop_event
from specdec.engine.logprobs import TokenLogprob
from specdec.cluster.records import BadRecord, BadRecords
from specdec.cluster.redis_link import parse_scheduler_url, redacted
from specdec.cluster.registry import InstanceInfo, parse_registration
from specdec.cluster.secret import seal
from specdec.cluster.router import NoRoute, Router
from specdec.cluster.transfer import (MAGIC, MAX_HEADER_BYTES, TicketBook, TransferError, TransferServer,
                                      TransferTLS, frame_handoff, issue_ticket, send_handoff)
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
    Delta("ab", 2, logprobs=(TokenLogprob(5, -0.25, ((5, -0.25), (9, -1.5))), TokenLogprob(7, -2.0))),
    Finished("c", 3, 12, "length", SpecMetrics(), None, logprobs=(TokenLogprob(1, -0.5, ((1, -0.5),)),)),
    Delta("ab", 2, token_sources=[{"index": 0, "text": "a", "source": "decode"},
                                  {"index": 1, "text": "b", "source": "draft"}]),
    Finished("", 2, 12, "stop", SpecMetrics(), None, token_sources=[{"index": 2, "text": "", "source": "bonus"}]),
])
def test_events_survive_the_stream_encoding(event):
    fields = encode_event(event, attempt=2, seq=7)
    data = decode_event({key.encode(): value.encode() for key, value in fields.items()})
    assert (data["attempt"], data["seq"]) == (2, 7)
    assert to_loop_event(data) == event


# -- the KV transfer listener --------------------------------------------------------------------



HANDOFF_SECRET = b"unit-test-cluster-secret-0123456789"


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


def _ticket(secret=HANDOFF_SECRET, request_id: str = "r", decode: str = "d", ttl: float = 60.0) -> dict:
    return issue_ticket(secret, request_id=request_id, attempt=1, origin="o", decode=decode, ttl=ttl)


async def _with_server(handler, check, byte_cap=lambda n: 2**20, secret=HANDOFF_SECRET, **options):
    server = TransferServer("127.0.0.1", 0, handler, byte_cap, TicketBook("d", secret), **options)
    _, port = await server.start()
    try:
        return await check(f"127.0.0.1:{port}")
    finally:
        await server.close()


async def _exchange(address: str, payload: bytes, eof: bool = False) -> dict:
    """Send raw bytes to the listener; its one-line answer."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    if eof:
        writer.write_eof()
    await writer.drain()
    try:
        return json.loads(await asyncio.wait_for(reader.readline(), 10))
    finally:
        writer.close()


def _frame(ticket: dict, state: HandoffState, secret=HANDOFF_SECRET) -> tuple[bytes, bytes]:
    """``(head, body)``: a hand-off's bytes up to its header's MAC, and the rest."""
    head, views, body_tag = frame_handoff(ticket, 3, state, secret)
    return head, b"".join(bytes(view) for view in views) + body_tag


def _never(meta, state):  # pragma: no cover - reaching it fails the test
    raise AssertionError("a refused hand-off reached the engine")


@pytest.mark.parametrize("secret", [HANDOFF_SECRET, None])
def test_a_hand_off_arrives_whole_and_only_an_authenticated_one_may_share_its_prefix(secret):
    received = []

    async def handler(meta, state):
        received.append((meta, state))
        return None

    sent = _state()
    options = Options(tenant="key-0123", grammar={"text": '{"grammars": []}', "param": "response_format"},
                      token_sources=True)
    stats = asyncio.run(_with_server(handler, lambda address: send_handoff(address, _ticket(secret), 3, sent, secret,
                                                                           options=options), secret=secret))
    assert stats.num_bytes == sum(layer.nbytes for layer in sent.kv)
    [(meta, state)] = received
    assert meta == {"request_id": "r", "attempt": 1, "origin": "o", "seq": 3, "options": options}
    assert state.share_prefix is (secret is not None)  # unauthenticated blocks never join the prefix cache
    assert state.layout == sent.layout and state.sampling == sent.sampling
    for got, want in zip(state.kv, sent.kv):
        np.testing.assert_array_equal(got, want)


def test_the_handler_refusal_reaches_the_sender():
    async def handler(meta, state):
        return "instance d: at capacity"

    with pytest.raises(TransferError, match="at capacity"):
        asyncio.run(_with_server(handler, lambda address: send_handoff(address, _ticket(), 0, _state(), HANDOFF_SECRET)))


def test_more_bytes_than_the_positions_need_are_refused_before_the_body_is_read():
    head, _ = _frame(_ticket(), _state(num_positions=20))
    answer = asyncio.run(_with_server(_never, lambda address: _exchange(address, head), byte_cap=lambda n: 100 * n))
    assert answer["ok"] is False and "for 20 positions; this instance takes at most 2000" in answer["error"]


def _good_handoff_after(check):
    """``check(address)``, then a good hand-off to the same listener: it still works. Returns
    the check's result and the metas of the hand-offs that reached the handler."""
    received = []

    async def handler(meta, state):
        received.append(meta)
        return None

    async def run(address):
        result = await check(address)
        await send_handoff(address, _ticket(), 0, _state(), HANDOFF_SECRET)
        return result

    result = asyncio.run(_with_server(handler, run))
    assert received[-1]["seq"] == 0
    return result, received


@pytest.mark.parametrize("payload, error", [
    (b"GET / HTTP/1.1\r\n\r\n" + bytes(20), "bad magic"),
    (MAGIC + (2**32 - 1).to_bytes(4, "big") + bytes(8), f"is more than {MAX_HEADER_BYTES}"),
    # Not JSON, and unsigned: refused by its MAC, before the JSON parser sees it.
    (MAGIC + (5).to_bytes(4, "big") + bytes(8) + b"{nope" + bytes(32), "header's MAC does not match"),
    (MAGIC + (50).to_bytes(4, "big") + bytes(8) + b"{}", "closed the connection mid-message"),
])
def test_garbage_gets_an_error_answer_and_the_listener_goes_on(payload, error):
    answer, received = _good_handoff_after(lambda address: _exchange(address, payload, eof=True))
    assert answer["ok"] is False and error in answer["error"]
    assert len(received) == 1


@pytest.mark.parametrize("options, error", [
    (Options(tenant=7), "tenant: expected null or a string"),
    (Options(grammar={"text": "x" * MAX_GRAMMAR_BYTES, "param": "response_format"}), "grammar: expected null"),
    (Options(token_sources="yes"), "token_sources: expected a boolean"),
])
def test_a_hand_off_with_bad_options_is_refused_before_it_runs(options, error):
    with pytest.raises(TransferError, match=f"bad options: {error}"):
        asyncio.run(_with_server(_never, lambda address: send_handoff(address, _ticket(), 0, _state(), HANDOFF_SECRET,
                                                                      options=options)))


def test_a_sender_without_the_cluster_secret_cannot_hand_off():
    guessed = b"a-guessed-secret-not-the-cluster-one"
    with pytest.raises(TransferError, match="header's MAC does not match"):
        asyncio.run(_with_server(_never, lambda address: send_handoff(address, _ticket(guessed), 0, _state(), guessed)))


def test_a_replayed_hand_off_is_refused_before_its_body_is_read():
    head, body = _frame(_ticket(), _state())

    async def check(address):
        first = await _exchange(address, head + body)
        replay = await _exchange(address, head)  # the captured header alone gets the answer
        return first, replay

    (first, replay), received = _good_handoff_after(check)
    assert first == {"ok": True, "error": None} and len(received) == 2  # the first and the good one after

    assert replay["ok"] is False and "used already" in replay["error"]


@pytest.mark.parametrize("field, value", [("request_id", "victim"), ("origin", "attacker"), ("attempt", 7)])
def test_a_forged_request_id_or_origin_is_refused(field, value):
    """A captured hand-off rewritten to write into another request's stream: the header's MAC
    fails; re-signed by a holder of the secret, the ticket's own signature still does."""
    ticket = _ticket()
    forged = {**ticket, field: value}
    head, _ = _frame(forged, _state(), secret=None)  # a rewritten header keeps the captured MAC
    captured_tag = _frame(ticket, _state())[0][-32:]
    answers = asyncio.run(_with_server(_never, lambda address: asyncio.gather(
        _exchange(address, head[:-32] + captured_tag), _exchange(address, _frame(forged, _state())[0]))))
    assert "header's MAC does not match" in answers[0]["error"]
    assert "ticket's signature does not match" in answers[1]["error"]


@pytest.mark.parametrize("ticket, error", [
    (_ticket(decode="another"), "is for instance another, not d"),
    (_ticket(ttl=-1), "has expired"),
    (_ticket(ttl=10_000), "expires too late"),
])
def test_a_ticket_for_another_instance_or_out_of_its_time_is_refused(ticket, error):
    answer = asyncio.run(_with_server(_never, lambda address: _exchange(address, _frame(ticket, _state())[0])))
    assert answer["ok"] is False and error in answer["error"]


def test_a_tampered_body_is_refused_by_its_mac():
    head, body = _frame(_ticket(), _state())
    tampered = bytes([body[0] ^ 1]) + body[1:]
    answer = asyncio.run(_with_server(_never, lambda address: _exchange(address, head + tampered)))
    assert answer["ok"] is False and "body's MAC does not match" in answer["error"]


def test_idle_connections_cannot_exhaust_the_listener():
    """Connections that send nothing hold the listener's slots only for ``header_timeout``;
    one more than it reads at once is refused at once."""
    async def check(address):
        host, _, port = address.rpartition(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        await asyncio.sleep(0.05)  # let the listener take them
        extra = await _exchange(address, b"")
        idle_answers = [json.loads(await asyncio.wait_for(reader.readline(), 5)) for reader, _ in idle]
        for _, writer in idle:
            writer.close()
        await send_handoff(address, _ticket(), 0, _state(), HANDOFF_SECRET)  # the slots are free again
        return extra, idle_answers

    received = []

    async def handler(meta, state):
        received.append(meta)
        return None

    extra, idle_answers = asyncio.run(_with_server(handler, check, max_connections=2, header_timeout=0.5))
    assert extra["ok"] is False and "busy: 2 hand-offs" in extra["error"]
    assert all("timed out" in answer["error"] for answer in idle_answers)
    assert len(received) == 1


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (its own CA), made with the openssl CLI."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return TransferTLS(str(cert), str(key), ca=str(cert))


def test_over_tls_a_hand_off_arrives_and_a_plaintext_or_certificateless_sender_is_refused(tls_files):
    received = []

    async def handler(meta, state):
        received.append(meta)
        return None

    async def check(address):
        await send_handoff(address, _ticket(), 0, _state(), HANDOFF_SECRET, tls=tls_files.client_context())
        for tls in (None, ssl.create_default_context(cafile=tls_files.ca)):  # no TLS; TLS without a client cert
            with pytest.raises(TransferError):
                await send_handoff(address, _ticket(), 0, _state(), HANDOFF_SECRET, tls=tls, timeout=5)

    asyncio.run(_with_server(handler, check, tls=tls_files.server_context()))
    assert len(received) == 1


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


def test_a_job_is_checked_field_by_field_before_it_runs():
    from specdec.cluster.messages import Job
    from specdec.cluster.records import BadRecord

    secret = b"s" * 32
    good = dict(request_id="r", attempt=1, origin="a", kind="run", prompt=[1, 2], sampling={})
    assert Job.from_json(Job(**good).to_json(secret), secret).prompt == [1, 2]
    options = dict(tenant="key-0123", grammar={"text": "start: /[a-z]+/", "param": "tools"}, token_sources=True)
    assert Job.from_json(Job(**good, **options).to_json(secret), secret).options == Options(**options)
    cases = {
        b"not json": "malformed",
        b"[1, 2]": "malformed",
        Job(**good).to_json(None): "signature",
        Job(**good).to_json(b"t" * 32): "signature",
        Job(**{**good, "attempt": "x"}).to_json(secret): "field",
        Job(**{**good, "attempt": True}).to_json(secret): "field",
        Job(**{**good, "prompt": [1, -2]}).to_json(secret): "field",
        Job(**{**good, "prompt": []}).to_json(secret): "field",
        Job(**{**good, "kind": "shell"}).to_json(secret): "field",
        Job(**{**good, "request_id": "x" * 300}).to_json(secret): "field",
        Job(**{**good, "decode": "10.0.0.9:1"}).to_json(secret): "field",
        Job(**{**good, "tenant": "k" * 300}).to_json(secret): "field",
        Job(**{**good, "grammar": "start: x"}).to_json(secret): "field",
        Job(**{**good, "grammar": {"text": "x" * MAX_GRAMMAR_BYTES, "param": "tools"}}).to_json(secret): "field",
        Job(**{**good, "token_sources": 1}).to_json(secret): "field",
    }
    for data, reason in cases.items():
        with pytest.raises(BadRecord) as info:
            Job.from_json(data, secret)
        assert info.value.reason == reason, (data, info.value)
