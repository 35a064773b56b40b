"""Prefill and decode instances of a real cluster (``redis-server`` on loopback, ``specdec serve``
subprocesses, the official ``openai`` client), and the attacks on their hand-offs and jobs that
docs/deployment.md's "Security" section describes: garbage sent to the KV transfer port while a
stream is in flight, a job pushed twice, a job that names a foreign transfer address, and an
instance that registers and never takes its jobs (a black hole).
"""

from __future__ import annotations

import asyncio
import json
import time

import attrs
import pytest
import redis
from cluster_harness import (_SOLO_ENGINES, CLUSTER_SECRET, MODEL_NAME, solo_outputs, start_instances,
                             wait_for_instances)
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
