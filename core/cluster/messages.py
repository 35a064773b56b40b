"""What instances send each other through Redis: jobs, and a request's events.

A **job** (JSON in the target's job list) asks an instance to run a request:

    {"request_id", "attempt", "origin", "kind": "run" | "prefill", "prompt": [ids],
     "sampling": {...}, "decode": {"instance_id", "needs_hidden_states", "ticket"} | null,
     "tenant": id | null, "grammar": {"text", "param"} | null, "token_sources": bool}

sealed with the cluster secret when there is one (:func:`.secret.seal`): an instance runs only
jobs signed with its cluster's secret. The decode instance's transfer address is not in the
job: the prefill instance looks it up in its own view of the cluster, so that a job cannot send
the prompt and KV anywhere else. ``ticket`` (:func:`.transfer.issue_ticket`) is what the decode
instance takes the hand-off on.

``origin`` is the instance the client is connected to; ``attempt`` counts the times the origin
has dispatched the request (it re-dispatches a request that was lost before anything of it
reached the client, see :mod:`.remote`). ``kind`` ``prefill`` asks for the prompt and first
token only, then the hand-off of the request to ``decode``.

``tenant``, ``grammar`` and ``token_sources`` are the request's *options* (:class:`Options`):
what the origin's server knows of the request beyond its tokens and sampling, which whoever
generates its tokens needs. ``tenant`` is the hashed API key (:mod:`specdec.server.tenant`) that
a proposer such as ``suffix`` keeps its caches apart by; ``grammar`` is a structured-output
grammar as text (``response_format``, a constrained ``tool_choice``): the row processors that
apply it are Python objects, so the instance that runs the job compiles the text again with
its own :class:`~specdec.structured.grammar.GrammarCompiler` (the origin compiled it already,
which is where a bad schema is a 400 naming its field); ``token_sources``: the events carry
which tokens were accepted drafts (``include_token_sources``). A prefill instance hands the
options on to the decode instance in the hand-off's header (:mod:`.transfer`), which is signed
like the job.

An **event** (one field ``e`` of an entry in the request's stream) mirrors the engine loop's
events (:mod:`specdec.server.engine_loop`) with the attempt and a sequence number:

    {"attempt", "seq", "type": "admitted" | "rejected" | "delta" | "finished" | "busy", ...}

Sequence numbers let the origin see an event that went missing (Redis restarted between its
write and its read). ``busy``: the job could not run (an instance at capacity or stopping, or
a hand-off that failed); its ``instance`` field names the instance to avoid.
"""

from __future__ import annotations

import json
from typing import Optional

import attrs

from ..metrics import SpecMetrics
from ..engine.logprobs import TokenLogprob
from ..sampling import SamplingParams
from ..server.engine_loop import Admitted, Delta, Event, Finished, Rejected
from .records import BadRecord
from .secret import BadSignature, seal, unseal


def sampling_to_dict(sampling: SamplingParams) -> dict:
    data = attrs.asdict(sampling)
    data["stop"] = list(data["stop"])
    return data


def sampling_from_dict(data: dict) -> SamplingParams:
    return SamplingParams(**data)


def logprobs_to_list(entries) -> list:
    """An event's logprob entries as JSON lists: ``[token id, logprob, [[id, logprob], ...]]``."""
    return [[e.token_id, e.logprob, [list(pair) for pair in e.top]] for e in entries]


def logprobs_from_list(data) -> tuple:
    return tuple(TokenLogprob(int(token), float(logprob), tuple((int(t), float(lp)) for t, lp in top))
                 for token, logprob, top in data or ())


def metrics_to_dict(metrics: SpecMetrics) -> dict:
    return {"num_steps": metrics.num_steps, "num_drafts": metrics.num_drafts,
            "num_draft_tokens": metrics.num_draft_tokens, "num_accepted_tokens": metrics.num_accepted_tokens,
            "num_emitted_tokens": metrics.num_emitted_tokens,
            "accepted_per_position": list(metrics.accepted_per_position),
            "num_prediction_accepted": metrics.num_prediction_accepted,
            "num_prediction_rejected": metrics.num_prediction_rejected,
            "num_proposer_off_steps": metrics.num_proposer_off_steps}


def metrics_from_dict(data: dict) -> SpecMetrics:
    return SpecMetrics(**data)


#: Bounds of a job's fields (far above any real job's; a prompt's length is the engine's to check).
MAX_ID_CHARS = 256
MAX_ATTEMPTS = 10_000
MAX_PROMPT_IDS = 2**20
#: The largest grammar a job or a hand-off carries: bytes of its text as JSON (``json.dumps``,
#: ASCII). Far above a real schema's grammar; a bigger one is a 400 at the origin.
MAX_GRAMMAR_BYTES = 2**20


@attrs.frozen(kw_only=True)
class Options:
    """A request's options that travel with its job and its hand-off (see the module docstring).

    :ivar tenant: who sent it (``tenant_of``), or None.
    :ivar grammar: ``{"text": llguidance grammar, "param": the request field it came from}``, or None.
    :ivar token_sources: whether its events carry ``token_sources``.
    """

    tenant: Optional[str] = None
    grammar: Optional[dict] = None
    token_sources: bool = False

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data) -> "Options":
        """The options :meth:`to_dict` gave, checked (:func:`check_options`); BadRecord when not."""
        check_options(data)
        return cls(**data)


def grammar_bytes(text: str) -> int:
    """The bytes of a grammar's text as a job holds it (what :data:`MAX_GRAMMAR_BYTES` bounds)."""
    return len(json.dumps(text))


def check_options(data) -> None:
    """Raise :class:`~.records.BadRecord` unless ``data`` is an :class:`Options` dict within bounds."""
    if not isinstance(data, dict) or set(data) - {"tenant", "grammar", "token_sources"}:
        raise BadRecord("field", "options: expected an object of tenant, grammar and token_sources")
    tenant = data.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_ID_CHARS):
        raise BadRecord("field", f"tenant: expected null or a string of 1 to {MAX_ID_CHARS} characters")
    grammar = data.get("grammar")
    if grammar is not None and (
            not isinstance(grammar, dict) or set(grammar) != {"text", "param"}
            or not isinstance(grammar["text"], str) or not isinstance(grammar["param"], str)
            or not 0 < len(grammar["param"]) <= MAX_ID_CHARS or grammar_bytes(grammar["text"]) > MAX_GRAMMAR_BYTES):
        raise BadRecord("field", f"grammar: expected null or an object of two strings, text (at most "
                                 f"{MAX_GRAMMAR_BYTES} bytes as JSON) and param")
    if type(data.get("token_sources", False)) is not bool:
        raise BadRecord("field", "token_sources: expected a boolean")


@attrs.define(slots=True, kw_only=True)
class Job:
    """One request handed to another instance (see the module docstring)."""

    request_id: str
    attempt: int
    origin: str
    kind: str  # "run" or "prefill"
    prompt: list
    sampling: dict
    decode: Optional[dict] = None
    tenant: Optional[str] = None
    grammar: Optional[dict] = None
    token_sources: bool = False

    @property
    def options(self) -> Options:
        """The request's :class:`Options`."""
        return Options(tenant=self.tenant, grammar=self.grammar, token_sources=self.token_sources)

    def to_json(self, secret: Optional[bytes] = None) -> bytes:
        """The job as its instance's list holds it, signed with ``secret`` when given."""
        return seal(secret, "job", attrs.asdict(self))

    @classmethod
    def from_json(cls, data: bytes, secret: Optional[bytes] = None) -> "Job":
        """The job :meth:`to_json` wrote; raises :class:`~.records.BadRecord` when it is not
        JSON, not signed with ``secret`` (when given), or a field is missing, mistyped or out
        of bounds (the engine checks the prompt and sampling values again when it runs it)."""
        try:
            fields = unseal(secret, "job", data)
        except BadSignature as exc:
            raise BadRecord("signature", str(exc)) from None
        except ValueError as exc:
            raise BadRecord("malformed", f"not a JSON object: {exc}") from None
        _check_job_fields(fields)
        return cls(**fields)

    @property
    def run_id(self) -> str:
        """The id the request runs under in an engine: unique per attempt, so that a second
        attempt never meets the first one's state anywhere."""
        return f"{self.request_id}.{self.attempt}"


def _check_job_fields(fields: dict) -> None:
    def problem(message: str) -> BadRecord:
        return BadRecord("field", message)

    known = {field.name for field in attrs.fields(Job)}
    if set(fields) - known or {"request_id", "attempt", "origin", "kind", "prompt", "sampling"} - set(fields):
        raise problem(f"fields {sorted(fields)}, expected {sorted(known)}")
    for name in ("request_id", "origin"):
        if not isinstance(fields[name], str) or not 0 < len(fields[name]) <= MAX_ID_CHARS:
            raise problem(f"{name}: expected a string of 1 to {MAX_ID_CHARS} characters")
    attempt = fields["attempt"]
    if type(attempt) is not int or not 0 <= attempt <= MAX_ATTEMPTS:
        raise problem(f"attempt: expected an integer from 0 to {MAX_ATTEMPTS}")
    if fields["kind"] not in ("run", "prefill"):
        raise problem("kind: expected run or prefill")
    prompt = fields["prompt"]
    if (not isinstance(prompt, list) or not 0 < len(prompt) <= MAX_PROMPT_IDS
            or any(type(token) is not int or token < 0 for token in prompt)):
        raise problem(f"prompt: expected 1 to {MAX_PROMPT_IDS} token ids (integers >= 0)")
    if not isinstance(fields["sampling"], dict):
        raise problem("sampling: expected an object")
    if fields.get("decode") is not None and not isinstance(fields["decode"], dict):
        raise problem("decode: expected an object or null")
    check_options({name: fields[name] for name in ("tenant", "grammar", "token_sources") if name in fields})


def encode_event(event: Event, attempt: int, seq: int) -> dict:
    """The stream fields of an engine-loop event."""
    data: dict = {"attempt": attempt, "seq": seq}
    if isinstance(event, Admitted):
        data.update(type="admitted", num_prompt_tokens=event.num_prompt_tokens)
    elif isinstance(event, Rejected):
        data.update(type="rejected", message=event.message, param=event.param, code=event.code)
    elif isinstance(event, Delta):
        data.update(type="delta", text=event.text, num_generated=event.num_generated,
                    logprobs=logprobs_to_list(event.logprobs), token_sources=event.token_sources)
    elif isinstance(event, Finished):
        data.update(type="finished", text=event.text, num_generated=event.num_generated,
                    num_prompt_tokens=event.num_prompt_tokens, finish_reason=event.finish_reason,
                    metrics=metrics_to_dict(event.metrics), error=event.error,
                    logprobs=logprobs_to_list(event.logprobs), token_sources=event.token_sources)
    else:  # pragma: no cover - every Event type is above
        raise TypeError(f"not an event: {event!r}")
    return {"e": json.dumps(data)}


def busy_event(attempt: int, seq: int, message: str, instance: str) -> dict:
    """The job could not be run; the origin tries again without ``instance`` (the one at
    capacity, or the decode instance a hand-off could not reach)."""
    return {"e": json.dumps({"attempt": attempt, "seq": seq, "type": "busy", "message": message,
                             "instance": instance})}


def decode_event(fields: dict) -> dict:
    """The JSON of a stream entry (fields as Redis returns them)."""
    return json.loads(fields[b"e"])


def to_loop_event(data: dict) -> Optional[Event]:
    """The engine-loop event of a decoded stream entry (None for ``busy``)."""
    kind = data["type"]
    if kind == "admitted":
        return Admitted(data["num_prompt_tokens"])
    if kind == "rejected":
        return Rejected(data["message"], data.get("param"), data.get("code"))
    if kind == "delta":
        return Delta(data["text"], data["num_generated"], logprobs=logprobs_from_list(data.get("logprobs")),
                     token_sources=data.get("token_sources"))
    if kind == "finished":
        return Finished(data["text"], data["num_generated"], data["num_prompt_tokens"], data["finish_reason"],
                        metrics_from_dict(data["metrics"]), data.get("error"),
                        logprobs=logprobs_from_list(data.get("logprobs")), token_sources=data.get("token_sources"))
    return None
