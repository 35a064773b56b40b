"""What a benchmark measures: one :class:`Sample` per request, summed up per method and batch
size (:class:`Summary`), printed as a table and written as ``results.json``.

Speeds are measured as the project's benchmarks measure them (benchmarks/bench_decode.py):
end to end per request (prefill included), decode alone (after the first token), each the
median over requests, plus the throughput of a whole batch size (all tokens / its wall time).
Acceptance per draft position is the share of drafting steps whose token ``i`` was accepted;
it is ``None`` (printed n/a) where the server does not report it (any server but specdec).
"""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import PurePosixPath
from typing import Optional

import attrs


@attrs.define
class Sample:
    """One request: its timings (seconds, measured by the client) and what speculation did."""

    method: str
    batch_size: int
    prompt_index: int
    completion_tokens: int
    ttft_s: float
    elapsed_s: float
    #: Target forward passes that emitted tokens, and drafts accepted per position; None when
    #: the server does not say (no ``usage.speculative``).
    num_steps: Optional[int] = None
    num_drafts: Optional[int] = None
    accepted_per_position: Optional[list[int]] = None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.elapsed_s - self.ttft_s
        return (self.completion_tokens - 1) / decode_time if decode_time > 0 and self.completion_tokens > 1 else 0.0


@attrs.define
class Summary:
    """The samples of one method at one batch size."""

    method: str
    batch_size: int
    requests: int
    tokens: int
    wall_s: float
    throughput_tokens_per_s: float
    median_tokens_per_s: float
    median_decode_tokens_per_s: float
    median_ttft_s: float
    mean_acceptance_length: Optional[float]
    acceptance_per_position: Optional[list[float]]


def summarize(samples: list[Sample], walls: dict[tuple[str, int], float]) -> list[Summary]:
    """One :class:`Summary` per (method, batch size), in the order they first appear;
    ``walls`` holds each one's wall time (its requests' batches, end to end)."""
    groups: dict[tuple[str, int], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.method, sample.batch_size), []).append(sample)
    summaries = []
    for (method, batch_size), group in groups.items():
        tokens = sum(s.completion_tokens for s in group)
        wall = walls[(method, batch_size)]
        summaries.append(Summary(
            method=method, batch_size=batch_size, requests=len(group), tokens=tokens, wall_s=wall,
            throughput_tokens_per_s=tokens / wall if wall > 0 else 0.0,
            median_tokens_per_s=statistics.median(s.tokens_per_s for s in group),
            median_decode_tokens_per_s=statistics.median(s.decode_tokens_per_s for s in group),
            median_ttft_s=statistics.median(s.ttft_s for s in group),
            mean_acceptance_length=_acceptance_length(group),
            acceptance_per_position=_per_position(group)))
    return summaries


def _acceptance_length(group: list[Sample]) -> Optional[float]:
    if any(s.num_steps is None for s in group):
        return None
    steps = sum(s.num_steps for s in group)
    return sum(s.completion_tokens for s in group) / steps if steps else None


def _per_position(group: list[Sample]) -> Optional[list[float]]:
    if any(s.accepted_per_position is None for s in group):
        return None
    drafts = sum(s.num_drafts for s in group)
    width = max((len(s.accepted_per_position) for s in group), default=0)
    totals = [sum(s.accepted_per_position[i] for s in group if i < len(s.accepted_per_position))
              for i in range(width)]
    return [count / drafts for count in totals] if drafts else []


def cpu_name() -> str:
    """This machine's CPU model and its family and model numbers (``/proc/cpuinfo``: a VM may
    name only the vendor, and AMD's Zen 4 and Zen 5 differ in their family), or what the
    platform says."""
    from ..kernels.cpu import cpuinfo_fields

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            fields = cpuinfo_fields(info.read())
    except OSError:
        fields = {}
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def machine_description() -> str:
    """The CPU and the quantized kernels' path in this process, for a benchmark's header: one
    model's figures differ by both (:func:`specdec.kernels.cpu.kernel_path`)."""
    from ..kernels.cpu import kernel_path

    return f"CPU {cpu_name()}, {os.cpu_count()} CPUs; kernels {kernel_path()}"


def model_label(model: str) -> str:
    """How the table, the plots and their title name a model: a GGUF file by its name alone
    (llama-server names the model it serves by the path it was started with, and a whole path
    pushed the table's columns and the plots' titles out of sight); any other name as it is."""
    return PurePosixPath(model).name if model.lower().endswith(".gguf") else model


def format_table(summaries: list[Summary]) -> str:
    """The summaries as a plain-text table, one row per method and batch size."""
    width = max([12, *(len(s.method) + 2 for s in summaries)])
    header = (f"{'method':<{width}}{'batch':>6}{'reqs':>6}{'tokens':>8}{'thru tok/s':>12}{'tok/s':>8}"
              f"{'decode tok/s':>14}{'TTFT s':>8}{'accept len':>12}  accepted per position")
    lines = [header, "-" * len(header)]
    for s in summaries:
        length = "n/a" if s.mean_acceptance_length is None else f"{s.mean_acceptance_length:.2f}"
        per_position = ("n/a" if s.acceptance_per_position is None
                        else " ".join(f"{p:.2f}" for p in s.acceptance_per_position) or "-")
        lines.append(f"{s.method:<{width}}{s.batch_size:>6}{s.requests:>6}{s.tokens:>8}"
                     f"{s.throughput_tokens_per_s:>12.1f}"
                     f"{s.median_tokens_per_s:>8.1f}{s.median_decode_tokens_per_s:>14.1f}{s.median_ttft_s:>8.2f}"
                     f"{length:>12}  {per_position}")
    lines.append("thru: all tokens / wall time of the batch size; tok/s (end to end, prefill included), decode "
                 "tok/s (after the first token) and TTFT: medians per request")
    return "\n".join(lines)


def results_document(summaries: list[Summary], samples: list[Sample], setup: dict) -> dict:
    """What ``results.json`` holds: the setup (target, workload, CPU, ...), the summaries and
    every sample."""
    return {"setup": setup, "summaries": [attrs.asdict(s) for s in summaries],
            "samples": [attrs.asdict(s) for s in samples]}
