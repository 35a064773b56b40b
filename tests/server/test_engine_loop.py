"""The engine loop on a scripted stand-in engine (no model): deltas, stop strings, aborts,
the bound, engine failures and shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Optional

import pytest

from specdec.errors import SpecdecError
from specdec.metrics import SpecMetrics
from specdec.sampling import SamplingParams
from specdec.server.engine_loop import (ENGINE_ERROR_MESSAGE, Delta, EngineLoop, EngineStopped, Finished, QueueFull,
                                        RequestRejected)


class ScriptedRequest:
    def __init__(self, request_id: str, prompt_len: int, sampling: SamplingParams, pieces: list[str]):
        self.request_id, self.num_prompt_tokens, self.sampling = request_id, prompt_len, sampling
        self.pieces = list(pieces)
        self.text, self.num_generated, self.finish_reason = "", 0, None
        self.metrics = SpecMetrics()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ScriptedEngine:
    """Each step appends the next piece of text (one token) to every running request, and trims
    a completed stop string as the real engine does."""

    max_model_len = 50
    num_kv_blocks = 2

    def __init__(self, pieces: list[str], fail_on_step: Optional[int] = None):
        self.pieces, self.fail_on_step, self.steps = pieces, fail_on_step, 0
        self.waiting: list[ScriptedRequest] = []
        self.running: list[ScriptedRequest] = []

    @property
    def num_free_kv_blocks(self) -> int:
        return self.num_kv_blocks - len(self.running)

    def add_request(self, prompt_token_ids, sampling, prompt=None, request_id=None, tenant=None, row_processors=()):
        if list(prompt_token_ids) == [666]:
            raise ValueError("an engine bug")
        if len(prompt_token_ids) >= self.max_model_len:
            raise SpecdecError(f"prompt: {len(prompt_token_ids)} tokens do not fit the context of 50 tokens")
        request = ScriptedRequest(request_id, len(prompt_token_ids), sampling, self.pieces)
        self.waiting.append(request)
        return request

    def abort_request(self, request_id) -> bool:
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    request.finish_reason = "abort"
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self):
        time.sleep(0.001)  # a step takes time
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        while self.waiting and len(self.running) < self.num_kv_blocks:
            self.running.append(self.waiting.pop(0))
        finished = []
        for request in list(self.running):
            request.text += request.pieces.pop(0) if request.pieces else "."
            request.num_generated += 1
            request.metrics.record_step(0, 0, 1)
            for stop in request.sampling.stop:
                if stop in request.text:
                    request.text = request.text[: request.text.index(stop)]
                    request.finish_reason = "stop"
            if request.num_generated >= request.sampling.max_tokens:
                request.finish_reason = request.finish_reason or "length"
            if request.finished:
                self.running.remove(request)
                finished.append(request)
        return finished


def run(coroutine_fn, engine, **kwargs):
    loop_ = EngineLoop(engine, **kwargs)
    loop_.start()

    async def main():
        try:
            return await coroutine_fn(loop_)
        finally:
            await asyncio.to_thread(loop_.stop)

    return asyncio.run(main()), loop_


async def collect(stream) -> tuple[list[Delta], Finished]:
    await stream.admitted()
    events = [event async for event in stream]
    return events[:-1], events[-1]


def test_deltas_add_up_to_the_text():
    async def main(engine_loop):
        return await collect(engine_loop.submit([1, 2, 3], SamplingParams(max_tokens=4)))

    (deltas, final), engine_loop = run(main, ScriptedEngine(["Hel", "lo", " wor", "ld"]))
    assert [d.text for d in deltas] + [final.text] == ["Hel", "lo", " wor", "ld"]  # the last with the end
    assert [d.num_generated for d in deltas] == [1, 2, 3]
    assert (final.finish_reason, final.num_generated, final.num_prompt_tokens) == ("length", 4, 3)
    assert engine_loop.snapshot().num_pending == 0


def test_no_piece_of_a_stop_string_leaks_out():
    async def main(engine_loop):
        return await collect(engine_loop.submit([1], SamplingParams(max_tokens=10, stop=("o wor", "zz"))))

    (deltas, final), _ = run(main, ScriptedEngine(["Hel", "lo", " wo", "rld"]))
    assert "".join(d.text for d in deltas) + final.text == "Hell"
    assert final.finish_reason == "stop"


def test_rejected_request_and_the_bound():
    async def main(engine_loop):
        with pytest.raises(RequestRejected, match="do not fit the context"):
            await engine_loop.submit(list(range(60)), SamplingParams()).admitted()
        with pytest.raises(RequestRejected, match=r"^the request could not be added \(see the server log\)$"):
            await engine_loop.submit([666], SamplingParams()).admitted()
        first = engine_loop.submit([1], SamplingParams(max_tokens=100))
        await first.admitted()
        with pytest.raises(QueueFull):
            engine_loop.submit([1], SamplingParams())
        first.abort()
        while engine_loop.num_pending:
            await asyncio.sleep(0.01)
        second = engine_loop.submit([1], SamplingParams(max_tokens=1))
        return await collect(second)

    (_, final), engine_loop = run(main, ScriptedEngine(["a"] * 100), max_pending=1)
    assert final.finish_reason == "length"
    assert engine_loop.snapshot().num_free_kv_blocks == 2


def test_a_client_told_of_the_end_may_send_its_next_request_at_once(monkeypatch):
    """At the bound of one request in flight, a client that sends its next request the moment
    it hears the end of the last one is served, not told the server is full: the engine thread
    frees the request's slot before it sends the end (a fast machine's next request once
    arrived in between: a 503)."""
    from specdec.server import engine_loop as module

    pending_when_ended = []
    send = module._Tracked.send

    def recording_send(tracked, event):
        if isinstance(event, Finished):
            pending_when_ended.append(tracked.stream._engine_loop.num_pending)
        send(tracked, event)

    monkeypatch.setattr(module._Tracked, "send", recording_send)

    async def main(engine_loop):
        finals = []
        for _ in range(3):  # each sent as soon as the previous one ended
            finals.append((await collect(engine_loop.submit([1], SamplingParams(max_tokens=2))))[1])
        return finals

    finals, _ = run(main, ScriptedEngine(["a"] * 100), max_pending=1)
    assert [f.finish_reason for f in finals] == ["length"] * 3
    assert pending_when_ended == [0, 0, 0]


def test_an_engine_failure_fails_the_running_requests_and_the_loop_goes_on():
    async def main(engine_loop):
        _, failed = await collect(engine_loop.submit([1], SamplingParams(max_tokens=5)))
        _, after = await collect(engine_loop.submit([1], SamplingParams(max_tokens=2)))
        return failed, after

    (failed, after), _ = run(main, ScriptedEngine(["a"] * 10, fail_on_step=2))
    assert failed.error == ENGINE_ERROR_MESSAGE and failed.finish_reason == "error"  # no exception text
    assert after.error is None and after.finish_reason == "length"


def test_stop_ends_the_requests_in_flight():
    async def main(engine_loop):
        stream = engine_loop.submit([1], SamplingParams(max_tokens=10 ** 6))
        await stream.admitted()
        await asyncio.to_thread(engine_loop.stop)
        events = [event async for event in stream]
        with pytest.raises(EngineStopped):
            engine_loop.submit([1], SamplingParams())
        return events[-1]

    final, engine_loop = run(main, ScriptedEngine(["a"] * 10))
    assert final.finish_reason == "abort" and final.error is None
    assert not engine_loop.running


# -- plugin code that misbehaves on the engine thread ------------------------------------------


class MisbehavingEngine(ScriptedEngine):
    """A scripted engine whose step ``n`` runs ``action()`` first: what a plugin called inside
    the step would do (raise SystemExit, block)."""

    def __init__(self, pieces: list[str], actions: dict):
        super().__init__(pieces)
        self.actions = actions

    def step(self):
        action = self.actions.get(self.steps + 1)
        if action is not None:
            self.steps += 1
            action()
        return super().step()


@pytest.mark.parametrize("escape", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()],
                         ids=lambda exc: type(exc).__name__)
def test_a_base_exception_in_a_step_fails_its_requests_and_the_thread_serves_on(escape):
    """What a plugin's ``sys.exit()`` inside a step did: end the engine thread, leaving a server
    that answered 503 forever."""
    async def main(engine_loop):
        _, failed = await collect(engine_loop.submit([1], SamplingParams(max_tokens=5)))
        problem = engine_loop.problem
        deltas, after = await collect(engine_loop.submit([1], SamplingParams(max_tokens=2)))
        return failed, problem, "".join(d.text for d in deltas) + after.text, after

    def raise_it():
        raise escape

    (failed, problem, text, after), engine_loop = run(main, MisbehavingEngine(["a"] * 10, {2: raise_it}))
    assert (failed.finish_reason, failed.error) == ("error", ENGINE_ERROR_MESSAGE)
    assert problem is None
    assert (after.finish_reason, after.error, text) == ("length", None, "aa")
    assert engine_loop.snapshot().num_pending == 0


def test_a_stalled_step_fails_its_requests_at_the_deadline_and_the_loop_recovers_when_it_returns():
    release = threading.Event()

    async def main(engine_loop):
        started = time.monotonic()
        stalled = engine_loop.submit([1], SamplingParams(max_tokens=5))
        _, failed = await collect(stalled)
        waited = time.monotonic() - started
        problem = engine_loop.problem
        with pytest.raises(EngineStopped) as refused:
            engine_loop.submit([1], SamplingParams(max_tokens=1))
        release.set()  # the hung step returns
        while engine_loop.problem is not None:
            await asyncio.sleep(0.01)
        _, after = await collect(engine_loop.submit([1], SamplingParams(max_tokens=2)))
        return failed, waited, problem, str(refused.value), after

    engine = MisbehavingEngine(["a"] * 10, {2: lambda: release.wait(30)})
    (failed, waited, problem, refused, after), engine_loop = run(main, engine, step_timeout=0.3)
    assert failed.finish_reason == "error"
    assert failed.error == problem == refused == (
        "the engine stalled: a step has run for more than the step timeout of 0.3 s (--step-timeout); "
        "the requests in flight were ended")
    assert waited < 5, "the request waited for the hung step instead of the deadline"
    assert (after.finish_reason, after.error) == ("length", None)
    assert engine_loop.snapshot().num_pending == 0 and engine_loop.snapshot().num_free_kv_blocks == 2


def test_an_engine_thread_that_dies_fails_its_requests_and_says_why():
    class DyingEngine(ScriptedEngine):
        def has_unfinished(self):  # the loop's own code, not a step: nothing guards it
            if self.steps >= 2:
                raise SystemExit(3)
            return super().has_unfinished()

    async def main(engine_loop):
        _, final = await collect(engine_loop.submit([1], SamplingParams(max_tokens=5)))
        with pytest.raises(EngineStopped) as refused:
            engine_loop.submit([1], SamplingParams())
        return final, str(refused.value)

    (final, refused), engine_loop = run(main, DyingEngine(["a"] * 10))
    message = "the engine thread died (SystemExit: 3); restart the server"
    assert (final.finish_reason, final.error) == ("error", message)
    assert refused == engine_loop.problem == message
    assert not engine_loop.running


def test_a_stats_line_while_busy_and_none_while_idle(caplog):
    """The periodic stats line (``specdec serve`` logs one every 10 s): live figures from the
    metrics while requests run, silence once the server is idle."""
    from specdec.server.metrics import ServerMetrics
    from specdec.server.stats_log import StatsLogger

    metrics = ServerMetrics("scripted")
    engine = ScriptedEngine(["tok"] * 400)

    async def main(engine_loop):
        stats = StatsLogger(metrics, engine_loop.snapshot, interval=0.05)
        try:
            await collect(engine_loop.submit([1, 2, 3], SamplingParams(max_tokens=300)))  # >= 0.3 s
            lines_busy = [r.getMessage() for r in caplog.records if r.name == "specdec.stats"]
            await asyncio.sleep(0.3)  # idle: several intervals pass
            return lines_busy, [r.getMessage() for r in caplog.records if r.name == "specdec.stats"]
        finally:
            stats.close()

    with caplog.at_level("INFO", logger="specdec.stats"):
        (busy, after_idle), _ = run(main, engine, metrics=metrics)
    assert busy, "no stats line while a request ran"
    assert all("requests in flight" in line and "generation" in line and "KV cache" in line for line in busy)
    assert any(float(line.split("generation ")[1].split(" tok/s")[0]) > 0 for line in busy)
    assert len(after_idle) <= len(busy) + 1  # at most the interval that saw the end


def test_log_level_covers_specdecs_own_loggers():
    import logging

    from specdec.server.stats_log import configure_logging

    root = logging.getLogger("specdec")
    saved = (root.level, list(root.handlers), root.propagate)
    try:
        root.handlers = []
        configure_logging("warning")
        assert logging.getLogger("specdec.cluster").getEffectiveLevel() == logging.WARNING
        assert not logging.getLogger("specdec.stats").isEnabledFor(logging.INFO)
        assert len(root.handlers) == 1
        configure_logging("debug")
        assert logging.getLogger("specdec.engine").isEnabledFor(logging.DEBUG) and len(root.handlers) == 1
    finally:
        root.level, root.handlers, root.propagate = saved
