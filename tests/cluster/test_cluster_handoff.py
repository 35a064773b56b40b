"""Prefill and decode instances of a real cluster (``redis-server`` on loopback, ``specdec serve``
subprocesses, the official ``openai`` client), and the attacks on their hand-offs and jobs that
docs/deployment.md's "Security" section describes: garbage sent to the KV transfer port while a
stream is in flight, a job pushed twice, a job that names a foreign transfer address, and an
instance that registers and never takes its jobs (a black hole).

Structured output (``response_format`` json_schema, a named ``tool_choice``) and
``include_token_sources`` through the same pairs: the grammar applies on the prefill instance's
first token and on the decode instance's, whose matcher starts where the prefill's left off.
And tenants: ``suffix`` in tenant scope keeps them apart on the decode instance.
"""

from __future__ import annotations

import asyncio
import json
import time

import attrs
import httpx
import jsonschema
import pytest
import redis
from cluster_harness import (_SOLO_ENGINES, CLUSTER_SECRET, MODEL_NAME, SCHEMAS, check_json_chat, json_chat,
                             solo_outputs, start_instances, wait_for_instances)
from test_cluster import MAX_TOKENS, PROMPTS, _complete, _outcomes

from specdec.cluster.messages import Job, sampling_to_dict
from specdec.cluster.redis_link import Keys, RedisLink, SchedulerConfig
from specdec.cluster.registry import ClusterView, InstanceInfo, read_instances, register
from specdec.cluster.remote import RemoteRequestStream
from specdec.cluster.router import Router
from specdec.cluster.transfer import MAGIC, MAX_HEADER_BYTES, frame_handoff, issue_ticket
from specdec.sampling import SamplingParams
from specdec.server.engine_loop import Finished

pytestmark = pytest.mark.slow

SECRET = CLUSTER_SECRET.encode()
KEYS = Keys()  # the default topic, as the harness's instances use
ATTACK_TOKENS = 48


@pytest.fixture(scope="module")
def solo():
    return solo_outputs(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module", params=["ngram", "mtp"])
def pd_pair(request, directory, redis_server):
    """A prefill and a decode instance of one speculative method (each method's pair starts
    once and serves every test that takes it)."""
    method = request.param
    prefill, decode = start_instances(
        redis_server.url, directory, (f"prefill-{method}", {"role": "prefill", "speculative": {"method": method}}),
        (f"decode-{method}", {"role": "decode", "speculative": {"method": method}}))
    try:
        wait_for_instances(prefill, 2)
        wait_for_instances(decode, 2)
        yield method, prefill, decode
    finally:
        prefill.stop()
        decode.stop()


ngram_pair = pytest.mark.parametrize("pd_pair", ["ngram"], indirect=True)


def test_prefill_and_decode_instances_match_a_single_instance(pd_pair, solo):
    method, prefill, decode = pd_pair
    prompts = PROMPTS[:8]
    calls = [_complete(prefill if i % 2 else decode, prompt, stream=i % 3 == 0) for i, prompt in enumerate(prompts)]
    assert asyncio.run(_outcomes(calls)) == solo[:8]
    received = decode.metric("specdec_kv_transfers_total", direction="received")
    sent = prefill.metric("specdec_kv_transfers_total", direction="sent")
    assert received == sent == len(prompts)
    assert decode.metric("specdec_kv_transfer_bytes_total", direction="received") > 0
    if method == "mtp":  # the hidden states travel with the KV, and the head drafts well from them
        assert decode.metric("specdec_spec_decode_acceptance_rate") > 0.2
    # Speculation ran on the decode side, and decoding happened there only.
    assert decode.metric("specdec_spec_decode_num_draft_tokens_total") > 0
    assert decode.metric("specdec_generation_tokens_total") > prefill.metric("specdec_generation_tokens_total")


# -- structured output and token sources ---------------------------------------------------------

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers and return the sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}


async def _tool_call(instance) -> dict:
    async with instance.async_openai() as client:
        response = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "What is 12 plus 30?"}], max_tokens=40,
            temperature=0, tools=[ADD_TOOL], tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "add"
    return json.loads(call.function.arguments)


def test_structured_output_and_token_sources_through_prefill_and_decode(pd_pair):
    """Each schema's output parses and validates, streamed and not; a named tool choice gives
    a call of that tool with valid arguments; the token sources make up the text, cover every
    token, and count the decode instance's accepted drafts."""
    _, prefill, decode = pd_pair

    async def run():
        calls = [json_chat(prefill if i % 2 else decode, entry, stream=i < 2) for i, entry in enumerate(SCHEMAS)]
        return await asyncio.gather(*calls, _tool_call(decode))

    *outputs, arguments = asyncio.run(run())
    jsonschema.validate(arguments, ADD_TOOL["function"]["parameters"])
    for entry, output in zip(SCHEMAS, outputs):
        check_json_chat(entry, *output)


@ngram_pair
def test_a_bad_schema_is_a_400_naming_the_field_on_a_cluster(pd_pair):
    _, prefill, _ = pd_pair
    schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    response = prefill.http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format.json_schema.schema.properties.a"


TENANT_SUFFIX = {"method": "suffix", "verify_strategy": "greedy", "num_speculative_tokens": 8,
                 "adaptive_draft_length": False, "suffix_decoding_cache_scope": "tenant"}


def test_a_tenants_suffix_tree_stays_its_own_on_the_decode_instance(directory, redis_server):
    """``suffix`` in tenant scope on a prefill and a decode instance without an API key (the
    tenant is the hashed bearer token), in a topic of their own: B asking A's question right
    after A gets no drafts from A's answer (the very figures of A's first request), while A
    asking again does. Without the tenant in the job and the hand-off, B would draft from A's."""
    options = {"speculative": TENANT_SUFFIX, "env": {"SPECDEC_API_KEY": ""},
               "extra": ("--scheduler-topic", "tenants")}
    prefill, decode = start_instances(redis_server.url, directory, ("prefill-suffix", {"role": "prefill", **options}),
                                      ("decode-suffix", {"role": "decode", **options}))
    try:
        wait_for_instances(prefill, 2)

        def complete(key: str) -> dict:
            response = httpx.post(prefill.url + "/v1/completions", timeout=120, headers={
                "Authorization": f"Bearer {key}"}, json={"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()

        a_first, b_first, a_again = (complete(key) for key in ("key-of-a", "key-of-b", "key-of-a"))
        assert decode.metric("specdec_kv_transfers_total", direction="received") == 3
    finally:
        prefill.stop()
        decode.stop()
    assert a_first["choices"][0]["text"] == b_first["choices"][0]["text"] == a_again["choices"][0]["text"]
    speculative = [r["usage"]["speculative"] for r in (a_first, b_first, a_again)]
    assert speculative[1] == speculative[0], speculative
    assert speculative[2]["num_accepted_tokens"] > speculative[0]["num_accepted_tokens"] + 5, speculative


# -- attacks -------------------------------------------------------------------------------------


def _registration(redis_server, instance_id: str) -> dict:
    """An instance's registration as Redis holds it (signed or not)."""
    record = json.loads(redis.Redis.from_url(redis_server.url).get(KEYS.instance(instance_id)))
    return json.loads(record["p"]) if isinstance(record.get("p"), str) else record


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _garbage() -> list[bytes]:
    """One of each kind of hostile message to a transfer port."""
    forged_ticket = issue_ticket(b"not-the-cluster-secret-at-all!!", request_id="victim", attempt=1, origin="x",
                                 decode="decode-ngram")
    head, _, _ = frame_handoff(forged_ticket, 0, _dummy_state(), b"not-the-cluster-secret-at-all!!")
    forged_len = head[:len(MAGIC) + 4] + (2**40).to_bytes(8, "big") + head[len(MAGIC) + 12:]
    return [
        b"\x00" * 65536,  # random junk: bad magic
        MAGIC + (2**32 - 1).to_bytes(4, "big") + bytes(8),  # a giant header length
        MAGIC + MAX_HEADER_BYTES.to_bytes(4, "big") + bytes(8) + b"[" * MAX_HEADER_BYTES + bytes(32),  # wrong MAC
        head,  # signed with a guessed secret
        forged_len,  # claiming a terabyte of body
    ]


def _dummy_state():
    import numpy as np

    from specdec.engine.handoff import HandoffState, KVLayout

    layout = KVLayout(backend="x", dtype="float16", block_size=16, num_layers=1, num_kv_heads=1, head_dim=8,
                      model="m", vocab_size=10)
    return HandoffState(request_id="r", prompt_token_ids=np.arange(20), output_token_ids=np.array([1]),
                        sampling=SamplingParams(max_tokens=4), rng_state={}, num_positions=20,
                        kv=[np.zeros((2, 2, 16, 8), np.float16)], hidden_states=None, layout=layout,
                        first_token_s=0.0)


async def _attack(address: str, payload: bytes) -> dict:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(payload)
        writer.write_eof()
        await writer.drain()
        return json.loads(await asyncio.wait_for(reader.readline(), 30) or b"{}")
    except OSError:  # refused and closed before it had read everything: refused all the same
        return {"ok": False, "error": "closed early"}
    finally:
        writer.close()


@ngram_pair
def test_garbage_hand_offs_during_a_stream_harm_neither_it_nor_the_decode_instance(pd_pair, redis_server):
    _, prefill, decode = pd_pair
    [expected] = solo_outputs([PROMPTS[8]], ATTACK_TOKENS)
    address = _registration(redis_server, "decode-ngram")["transfer"]
    received_before = decode.metric("specdec_kv_transfers_total", direction="received")

    async def run():
        generated = decode.metric("specdec_generation_tokens_total")
        stream = asyncio.ensure_future(_complete(prefill, PROMPTS[8], stream=True, max_tokens=ATTACK_TOKENS))
        while decode.metric("specdec_generation_tokens_total") == generated:  # decoding there has begun
            await asyncio.sleep(0.05)
        assert not stream.done()
        rss_before = _rss_bytes(decode.process.pid)
        answers = await asyncio.gather(*(_attack(address, payload) for payload in _garbage() * 8))
        return await stream, answers, rss_before

    text, answers, rss_before = asyncio.run(run())
    assert text == expected
    assert not any(answer.get("ok") for answer in answers)
    assert decode.metric("specdec_kv_transfers_total", direction="received") == received_before + 1
    assert _rss_bytes(decode.process.pid) <= 1.10 * rss_before
    assert decode.health()["status"] == "ok"


@ngram_pair
def test_a_job_pushed_twice_runs_once_and_hands_off_only_to_a_registered_decode_instance(pd_pair, solo,
                                                                                         redis_server):
    """The origin's RPUSH retried after its reply was lost (the same run id twice), and a job
    that names a foreign ``decode.transfer``: the request runs once, its stream holds one run,
    and its KV goes to the registered decode instance, never to the address in the job. Garbage
    ahead of it in the list (not JSON, unsigned, signed with mistyped fields) is skipped and
    counted, one by one."""
    _, prefill, decode = pd_pair
    store = redis.Redis.from_url(redis_server.url)
    trap_connections = []

    async def run():
        def caught(reader, writer):
            trap_connections.append(writer.get_extra_info("peername"))
            writer.close()

        trap = await asyncio.start_server(caught, "127.0.0.1", 0)
        trap_address = "127.0.0.1:%d" % trap.sockets[0].getsockname()[1]
        tokenizer = next(iter(_SOLO_ENGINES.values())).tokenizer
        ticket = issue_ticket(SECRET, request_id="pushed-twice", attempt=1, origin="prefill-ngram",
                              decode="decode-ngram")
        job = Job(request_id="pushed-twice", attempt=1, origin="prefill-ngram", kind="prefill",
                  prompt=tokenizer.encode(PROMPTS[1]), sampling=sampling_to_dict(SamplingParams(max_tokens=MAX_TOKENS)),
                  decode={"instance_id": "decode-ngram", "needs_hidden_states": False, "ticket": ticket,
                          "transfer": trap_address})
        mistyped = Job(request_id="mistyped", attempt="x", origin="prefill-ngram", kind="run", prompt=[1, -2],
                       sampling={})
        garbage = [b"not json", Job(**{**attrs.asdict(job), "request_id": "unsigned"}).to_json(None),
                   mistyped.to_json(SECRET)]
        store.rpush(KEYS.jobs("prefill-ngram"), *garbage, job.to_json(SECRET), job.to_json(SECRET))
        events, last_id = [], "0-0"
        deadline = time.monotonic() + 60
        while not events or events[-1]["type"] != "finished":
            assert time.monotonic() < deadline, events
            reply = await asyncio.to_thread(store.xread, {KEYS.events("pushed-twice"): last_id}, block=500)
            for _, items in reply or ():
                for last_id, fields in items:
                    events.append(json.loads(fields[b"e"]))
        trap.close()
        return events

    events = asyncio.run(run())
    assert [event["seq"] for event in events] == list(range(len(events)))  # one run, no event twice
    assert [event["type"] for event in events].count("admitted") == 1
    assert "".join(event["text"] for event in events if event["type"] == "delta") + events[-1]["text"] == solo[1]
    assert trap_connections == []
    assert {reason: prefill.metric("specdec_cluster_bad_records_total", kind="job", reason=reason)
            for reason in ("malformed", "signature", "field")} == {"malformed": 1, "signature": 1, "field": 1}
    assert "refused a second job for run pushed-twice.1" in prefill.log.read_text(errors="replace")


def test_an_instance_that_never_takes_its_jobs_cannot_black_hole_a_request(redis_server):
    """A registration that looks sane (the registry refuses absurd ones) and never takes a job:
    the request fails within its dispatch deadline, with a message that says so."""
    url = redis_server.url.rsplit("/", 1)[0] + "/1"  # a database of its own: no other instance sees it

    async def run():
        link = RedisLink(SchedulerConfig(url=url))
        hole = InstanceInfo(instance_id="black-hole", role="mixed", model=MODEL_NAME, url="http://127.0.0.1:9",
                            num_pending=0, max_pending=8)
        await register(link, hole, SECRET)
        view = ClusterView(link)
        view.update(await read_instances(link, SECRET))
        me = InstanceInfo(instance_id="origin", role="prefill", model=MODEL_NAME, url="http://127.0.0.1:8")
        router = Router(me)
        route = router.choose(view.live())
        assert (route.kind, route.target.instance_id) == ("run", "black-hole")  # the hole wins the routing
        started = time.monotonic()
        stream = RemoteRequestStream("black-holed", link, view, "origin", route, [1, 2, 3],
                                     SamplingParams(max_tokens=4), lambda exclude: router.choose(view.live(), exclude),
                                     secret=SECRET, dispatch_deadline=1.0)
        final = await asyncio.wait_for(stream.final(), 10)
        await link.close()
        return final, time.monotonic() - started

    final, seconds = asyncio.run(run())
    assert isinstance(final, Finished) and final.finish_reason == "error"
    assert "instance black-hole did not take this request within 1 s" in final.error
    assert seconds < 5
