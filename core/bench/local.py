"""In-process benchmark runs: one loaded model, several speculative methods, several batch sizes.

The methods take turns batch by batch (each batch of prompts runs once per method before the
next batch), so that a slow spell of a shared machine hits them alike; each run prefills its
prompts itself (the prefix cache is reset between runs). A batch of size B is one batched
``generate`` of B prompts (cycling through the workload when it has fewer).
"""

from __future__ import annotations

import math
import sys
import time
from ..errors import SpecdecError
from ..sampling import SamplingParams
from .prompts import Conversation
from .results import Sample


def batches(conversations: list[Conversation], batch_size: int) -> list[list[tuple[int, Conversation]]]:
    """The workload in batches of ``batch_size`` (index, conversation) pairs: at least one full
    batch, the conversations cycled to fill the last one."""
    count = math.ceil(max(len(conversations), batch_size) / batch_size) * batch_size
    indexed = [(i % len(conversations), conversations[i % len(conversations)]) for i in range(count)]
    return [indexed[start:start + batch_size] for start in range(0, count, batch_size)]


def run_local(llm, methods: dict[str, object], conversations: list[Conversation], sampling: SamplingParams,
              batch_sizes: list[int], progress: bool = True) -> tuple[list[Sample], dict]:
    """Run every method on ``llm`` (a :class:`specdec.LLM`) at every batch size; return the
    samples and the wall time of each (method, batch size)."""
    from tqdm import tqdm

    prompt_ids = [llm.tokenizer.encode_chat(c) for c in conversations]
    plan = {size: batches(list(range(len(conversations))), size) for size in batch_sizes}
    total = sum(len(b) for size in batch_sizes for b in plan[size]) * len(methods)
    samples, walls = [], {}
    warm_up = SamplingParams(max_tokens=4, temperature=0.0)
    for name, spec in methods.items():  # first calls of each method's code paths
        _use(llm, name, spec)
        llm.generate([prompt_ids[0]], warm_up)
    # disable=None: no bar when stderr is no terminal (a log file)
    with tqdm(total=total, desc="bench", unit="req", file=sys.stderr, leave=False,
              disable=None if progress else True) as bar:
        for size in batch_sizes:
            for batch in plan[size]:
                ids = [prompt_ids[index] for index, _ in batch]
                for name, spec in methods.items():
                    _use(llm, name, spec)
                    llm.reset_prefix_cache()
                    start = time.perf_counter()
                    outputs = llm.generate(ids, sampling)
                    walls[(name, size)] = walls.get((name, size), 0.0) + time.perf_counter() - start
                    samples.extend(_sample(name, size, index, output) for (index, _), output in zip(batch, outputs))
                    bar.update(len(batch))
    return samples, walls


def _use(llm, name: str, spec) -> None:
    try:
        llm.set_speculative_config(spec)
    except SpecdecError as exc:
        raise SpecdecError(f"--methods {name}: {exc}") from None


def _sample(method: str, batch_size: int, index: int, output) -> Sample:
    metrics = output.metrics
    return Sample(method=method, batch_size=batch_size, prompt_index=index,
                  completion_tokens=output.num_generated_tokens, ttft_s=output.first_token_s,
                  elapsed_s=output.elapsed_s, num_steps=metrics.num_steps, num_drafts=metrics.num_drafts,
                  accepted_per_position=list(metrics.accepted_per_position))
