"""specdec against llama.cpp on the same GGUF file, the same prompts, in one run.

    python benchmarks/bench_llamacpp.py --llama-python /path/to/venv/bin/python
        [--model smollm2-135m-instruct | FILE.gguf] [--prompts 6] [--max-tokens 128]
        [--methods naive,ngram,suffix] [--quantization gguf] [--threads 2] [--repeats 1]

llama.cpp is the peer users would otherwise pick; it is a benchmark-only install, in a venv of
its own (so that nothing of it reaches specdec's environment):

    python -m venv /tmp/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llama-venv/bin/pip install llama-cpp-python==0.3.36   # ~6 min

On a CPU with AMX (Intel Xeon from the 4th generation), that native build of 0.3.36 crashed in
our runs (a segmentation fault in ``ggml_backend_amx_mul_mat``, in a worker thread). Build it with
every native feature but AMX instead (``--no-cache-dir``: pip would reuse the crashing wheel):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
      -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
      /tmp/llama-venv/bin/pip install --no-cache-dir llama-cpp-python==0.3.36

Both engines get the same token ids: the code-edit prompts rendered with the model's chat
template by specdec's tokenizer. Greedy decoding, at most ``--max-tokens`` new tokens, stop
at EOS, batch 1. llama.cpp runs in a subprocess of ``--llama-python`` (one request at a time,
never beside specdec), with ``--threads`` threads; its rows are plain decoding and its
prompt-lookup decoding (``LlamaPromptLookupDecoding``, 5 tokens). The engines take turns prompt
by prompt (a shared machine's slow spells then hit them alike). Each engine's KV cache is
emptied before every prompt, so every request pays its prefill.

Columns: prefill tok/s (prompt tokens / time to the first token), decode tok/s (tokens after
the first / the time they took), end-to-end tok/s (new tokens / the whole request), ms per
decode step, and the memory-bandwidth floor of a step: the bytes of weights one step reads
divided by the bandwidth measured in the same run (2 threads streaming a 1 GiB buffer). A
plain decode step cannot take less; a speculative step reads the weights once for several
tokens, so its floor per token is lower.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import numpy as np

import specdec
from specdec.bench.results import machine_description
from specdec.metrics import SpecMetrics
from specdec.workloads import code_edit_prompts

#: Runs in the llama.cpp venv, for the whole run: reads {"model", "threads"} as its first line,
#: loads the model twice (plain, and with prompt-lookup drafts), prints "ready", then answers
#: each line {"ids": [...], "max_tokens", "eos": [ids], "lookup": bool} with one JSON line.
LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
setup = json.loads(sys.stdin.readline())
engines = {lookup: Llama(model_path=setup["model"], n_threads=setup["threads"], n_threads_batch=setup["threads"],
                         n_ctx=4096, n_batch=512, verbose=False,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=5) if lookup else None)
           for lookup in (False, True)}
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    llm, eos = engines[job["lookup"]], set(job["eos"])
    llm.reset()
    start = time.perf_counter(); first = None; out = []
    for token in llm.generate(job["ids"], top_k=1, temp=0.0, reset=True):
        if first is None:
            first = time.perf_counter()
        if token in eos:
            break
        out.append(token)
        if len(out) >= job["max_tokens"]:
            break
    end = time.perf_counter()
    print(json.dumps({"prompt_tokens": len(job["ids"]), "tokens": len(out), "first_s": first - start,
                      "total_s": end - start, "ids": out}), flush=True)
"""


#: The model's stop ids (filled in by main).
STOP_IDS: set[int] = set()


def measure_bandwidth(threads: int = 2, size: int = 1 << 30) -> float:
    """GB/s that ``threads`` threads read from memory (each sums its part of a buffer far larger
    than the caches; numpy releases the GIL while it sums)."""
    buffer = np.ones(size // 8, dtype=np.int64)
    parts = np.array_split(buffer, threads)
    best = 0.0
    for _ in range(3):
        workers = [threading.Thread(target=part.sum) for part in parts]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, size / (time.perf_counter() - start) / 1e9)
    return best


class LlamaCpp:
    """llama.cpp in a subprocess of ``python`` (its own venv), the model loaded once; one
    request at a time, so that it never runs beside specdec."""

    def __init__(self, python: str, model_path: str, threads: int):
        self.process = subprocess.Popen([python, "-c", LLAMA_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        self.process.stdin.write(json.dumps({"model": model_path, "threads": threads}) + "\n")
        self.process.stdin.flush()
        if self.process.stdout.readline().strip() != "ready":
            sys.exit(f"llama.cpp failed to load {model_path} (exit {self.process.wait()})")

    def generate(self, ids: list[int], max_tokens: int, eos: list[int], lookup: bool) -> dict:
        job = {"ids": ids, "max_tokens": max_tokens, "eos": eos, "lookup": lookup}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"llama.cpp run failed (exit {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def agreement(runs: list[list[int]], reference: list[list[int]]) -> float:
    """Tokens of ``reference`` that ``runs`` reproduce up to their first difference, as a share
    (end-of-sequence ids are left out: specdec's outputs keep the stop token, llama.cpp's not)."""
    common = total = 0
    for run, ref in zip(runs, reference):
        run, ref = [t for t in run if t not in STOP_IDS], [t for t in ref if t not in STOP_IDS]
        total += len(ref)
        common += next((i for i, (a, b) in enumerate(zip(run, ref)) if a != b), min(len(run), len(ref)))
    return common / max(1, total)


def row(name, results, steps, weight_bytes, bandwidth):
    prompt = sum(r["prompt_tokens"] for r in results)
    first = sum(r["first_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    total = sum(r["total_s"] for r in results)
    decode_time = total - first
    decode_tokens = tokens - len(results)
    step_ms = decode_time / max(1, steps) * 1e3
    return {"engine": name, "prefill": prompt / first, "decode": decode_tokens / decode_time, "e2e": tokens / total,
            "step_ms": step_ms, "floor_ms": weight_bytes / bandwidth / 1e6, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default="naive,ngram,suffix")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    args = parser.parse_args()

    from specdec.model.resolve import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    bandwidth = measure_bandwidth(args.threads)
    llm = specdec.LLM(model=args.model, quantization=args.quantization, progress=False)
    weights = llm.engine.model.weights
    weight_bytes = weights.weight_bytes() if hasattr(weights, "weight_bytes") else None
    prompts = [llm.encode_prompt(p, use_chat_template=True) for p in code_edit_prompts(args.prompts)]
    sampling = specdec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    configs = {"naive": {"method": "naive"},
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
               "suffix": {"method": "suffix", "num_speculative_tokens": args.k}}

    names = args.methods.split(",")
    for name in names:  # warm-up
        llm.set_speculative_config(configs[name])
        llm.generate([prompts[0]], specdec.SamplingParams(max_tokens=16))
    eos = sorted(llm.engine.eos_token_ids)
    STOP_IDS.update(eos)
    llama = LlamaCpp(args.llama_python, model_path, args.threads)
    for lookup in (False, True):  # warm-up
        llama.generate(prompts[0], 16, eos, lookup)
    engines = [f"specdec {name}" for name in names] + ["llama.cpp plain", "llama.cpp prompt lookup (5)"]
    results = {engine: [] for engine in engines}
    steps = dict.fromkeys(engines, 0)

    def run_specdec(name: str, ids: list[int]) -> None:
        llm.set_speculative_config(configs[name])
        llm.reset_prefix_cache()
        start = time.perf_counter()
        [out] = llm.generate([ids], sampling)
        total = time.perf_counter() - start
        results[f"specdec {name}"].append({"prompt_tokens": len(ids), "tokens": out.num_generated_tokens,
                                           "first_s": out.first_token_s, "total_s": total, "ids": out.token_ids})
        steps[f"specdec {name}"] += SpecMetrics.total([out.metrics]).num_steps - 1  # 1st: prefill

    def run_llama(engine: str, ids: list[int]) -> None:
        done = llama.generate(ids, args.max_tokens, eos, lookup=engine == engines[-1])
        results[engine].append(done)
        steps[engine] += done["tokens"] - 1  # plain: a step a token (lookup: shown per token)

    # The engines take turns prompt by prompt, each prompt starting with the next engine, so that
    # this machine's slow spells (it shares its cores) hit them alike.
    turn = 0
    for _ in range(args.repeats):
        for ids in prompts:
            for i in range(len(engines)):
                engine = engines[(turn + i) % len(engines)]
                if engine.startswith("specdec "):
                    run_specdec(engine.removeprefix("specdec "), ids)
                else:
                    run_llama(engine, ids)
            turn += 1
    llama.close()
    reference = [r["ids"] for r in results[engines[0]]]
    rows = [{**row(engine, results[engine], steps[engine], weight_bytes, bandwidth),
             "ids": [r["ids"] for r in results[engine]]} for engine in engines]
    del llm

    plain = next(r for r in rows if r["engine"] == "llama.cpp plain")
    print(f"model {model_path.rsplit('/', 1)[-1]}, specdec quantization {args.quantization}, {args.repeats} x "
          f"{len(prompts)} code-edit chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), greedy, at most "
          f"{args.max_tokens} new tokens, {args.threads} threads")
    print(machine_description())
    print(f"weights read per step {weight_bytes / 1e6:.1f} MB, measured bandwidth {bandwidth:.1f} GB/s: "
          f"floor {weight_bytes / bandwidth / 1e6:.2f} ms per step ({bandwidth * 1e9 / weight_bytes:.0f} steps/s)")
    header = (f"{'engine':<30}{'prefill tok/s':>14}{'decode tok/s':>13}{'e2e tok/s':>11}{'e2e vs plain':>13}"
              f"{'ms/step':>9}{'floor ms':>9}{'tokens':>8}{'as naive':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['engine']:<30}{r['prefill']:>14.0f}{r['decode']:>13.1f}{r['e2e']:>11.1f}"
              f"{r['e2e'] / plain['e2e']:>12.2f}x{r['step_ms']:>9.2f}{r['floor_ms']:>9.2f}{r['tokens']:>8}"
              f"{agreement(r['ids'], reference):>8.0%}")
    print("ms/step: decode time per target forward (llama.cpp lookup: per token); floor: weight bytes per step / "
          "bandwidth; as naive: share of specdec naive's tokens each run reproduced before it first differed "
          "(100%: the same ids; llama.cpp's own arithmetic parts at near-ties)")


if __name__ == "__main__":
    main()
