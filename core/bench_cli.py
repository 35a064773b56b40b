"""``specdec bench``: latency and throughput of speculative methods, in-process or against a
running OpenAI-compatible server (``--base-url``: specdec serve, llama-server, vLLM).

It prints a table (and the CPU it ran on) and writes ``--output-dir``: ``results.json`` (the
setup, a summary per method and batch size, every request) and the PNG plots of
:mod:`specdec.bench.plots`. In-process, the methods take turns batch by batch on one loaded
model; against a server the method is the server's (its speculative figures are read from
``usage.speculative`` when the server sends them, specdec does; otherwise they are n/a).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from .errors import SpecdecError

DEFAULT_METHODS = "naive,ngram"


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``specdec bench`` beyond the engine flags (which ``cli`` adds)."""
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=None, metavar="URL",
                        help="benchmark this OpenAI-compatible server (e.g. http://127.0.0.1:8080; specdec "
                             "serve, llama-server, vLLM) instead of an in-process engine (default: none, "
                             "in-process); --model then names the served model (default: its first)")
    target.add_argument("--api-key", default=None,
                        help="the server's API key (default: $SPECDEC_API_KEY, else $OPENAI_API_KEY)")
    target.add_argument("--methods", default=None,
                        help=f"in-process: the methods to compare, comma-separated (default: {DEFAULT_METHODS}; "
                             "with --speculative-config: naive and that config)")
    target.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="--base-url: how long one request may take")

    load = parser.add_argument_group("workload")
    load.add_argument("--workload", default="code-edit",
                      help="code-edit, chat, a JSONL file ({\"prompt\": ...} or {\"messages\": [...]} a line) or a "
                           "JSON file (a list of strings, or ShareGPT conversations)")
    load.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts to take from the workload")
    load.add_argument("--batch-sizes", default="1", metavar="B[,B...]",
                      help="requests at once, comma-separated, e.g. 1,8 (speed against batch size)")
    load.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate per request at most")
    load.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    load.add_argument("--ignore-eos", action="store_true",
                      help="generate --max-tokens even past EOS (a non-standard field vLLM, llama-server and "
                           "specdec accept)")

    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", default="specdec-bench", metavar="DIR",
                        help="where results.json and the PNG plots go")
    output.add_argument("--no-plots", dest="plots", action="store_false",
                        help="write results.json only (the plots need matplotlib: pip install "
                             "'paddle-specdec[bench]') (default: plots)")


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``; anything else than positive integers is a one-line error."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise SpecdecError(f"--batch-sizes: expected positive integers separated by commas, got {text!r}")
    return list(dict.fromkeys(sizes))


def _check_args(args) -> list[int]:
    if args.num_prompts < 1:
        raise SpecdecError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    if args.max_tokens < 1:
        raise SpecdecError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise SpecdecError(f"--temperature: must be >= 0, got {args.temperature:g}")
    if args.methods and args.speculative_config:
        raise SpecdecError("--methods: give --methods or --speculative-config, not both")
    if args.base_url is not None and (args.methods or args.speculative_config):
        raise SpecdecError("--methods/--speculative-config: against --base-url the method is the server's")
    if args.plots:
        from .bench.plots import require_matplotlib

        require_matplotlib()
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    _prepare_output_dir(Path(args.output_dir))
    return batch_sizes


def _prepare_output_dir(output_dir: Path) -> None:
    """Create ``--output-dir`` before the run, so that a path that cannot be written fails now."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecdecError(f"--output-dir: cannot create {output_dir}: {exc.strerror}") from None
    if not os.access(output_dir, os.W_OK):
        raise SpecdecError(f"--output-dir: cannot write into {output_dir}")


def run_bench(args, engine_config_of) -> int:
    """Run the benchmark ``args`` describe; ``engine_config_of(args, plugins)`` builds the
    in-process engine's config from the engine flags."""
    from .bench.prompts import load_workload
    from .bench.results import cpu_name, format_table, model_label, results_document, summarize

    batch_sizes = _check_args(args)
    conversations = load_workload(args.workload, args.num_prompts)
    if args.base_url is not None:
        samples, walls, setup = _bench_server(args, conversations, batch_sizes)
    else:
        samples, walls, setup = _bench_in_process(args, engine_config_of, conversations, batch_sizes)
    setup.update(workload=args.workload, num_prompts=len(conversations), max_tokens=args.max_tokens,
                 temperature=args.temperature, ignore_eos=args.ignore_eos, batch_sizes=batch_sizes,
                 cpu=cpu_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    summaries = summarize(samples, walls)
    title = (f"{setup['target']} - {model_label(setup['model'])}, {args.workload} x{len(conversations)}, "
             f"{args.max_tokens} tokens, CPU {setup['cpu']}")
    if "kernels" in setup:  # in process: the kernels' path here (a server's is its own)
        title += f"; kernels {setup['kernels']}"
    print(title)
    print(format_table(summaries))
    output_dir = Path(args.output_dir)
    results = output_dir / "results.json"
    try:
        results.write_text(json.dumps(results_document(summaries, samples, setup), indent=2) + "\n")
    except OSError as exc:
        raise SpecdecError(f"--output-dir: cannot write {output_dir}: {exc.strerror}") from None
    written = [results]
    if args.plots:
        from .bench.plots import write_plots

        written += write_plots(summaries, output_dir, title)
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def _bench_server(args, conversations, batch_sizes):
    from .bench.remote import OpenAIServer, run_remote
    from .bench.results import model_label

    api_key = args.api_key or os.environ.get("SPECDEC_API_KEY") or os.environ.get("OPENAI_API_KEY")
    server = OpenAIServer(args.base_url, api_key, timeout=args.request_timeout)
    try:
        model = args.model or server.first_model()
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature}
        if args.ignore_eos:
            body["ignore_eos"] = True
        # requests name the model as the server does; the table and plots by model_label
        samples, walls = run_remote(server, model_label(model), body, conversations, batch_sizes,
                                    progress=args.progress)
    finally:
        server.close()
    return samples, walls, {"target": server.base_url, "model": model}


def _bench_in_process(args, engine_config_of, conversations, batch_sizes):
    from .api import LLM
    from .bench.local import run_local
    from .plugin_manager import get_plugins
    from .sampling import SamplingParams

    plugins = get_plugins()
    config = engine_config_of(args, plugins)
    methods = _methods(args, config, plugins)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    llm = LLM(config=config, plugins=plugins, progress=args.progress)
    try:
        samples, walls = run_local(llm, methods, conversations, sampling, batch_sizes, progress=args.progress)
    finally:
        llm.engine.close()
    from .kernels.cpu import kernel_path

    kernels = kernel_path() if llm.engine.kernels == "cpu" else llm.engine.kernels  # triton, paddle
    setup = {"target": "in-process", "model": config.model, "kernels": kernels,
             "methods": {name: spec.to_dict() for name, spec in methods.items()}}
    return samples, walls, setup


def _methods(args, config, plugins) -> dict:
    """The speculative configs to compare, by name, each checked before the model loads."""
    from .config import build_speculative_config
    from .demo import demo_methods

    if args.speculative_config:
        return {"naive": build_speculative_config({"method": "naive"}, plugins),
                config.speculative.method: config.speculative}
    shown = demo_methods(plugins)
    methods = {}
    for name in (args.methods or DEFAULT_METHODS).split(","):
        name = name.strip()
        if name not in plugins.proposers.names():
            raise SpecdecError(f"--methods: unknown method {name!r}; installed: "
                               f"{', '.join(sorted(plugins.proposers.names()))}")
        methods[name] = build_speculative_config(shown.get(name, {"method": name}), plugins, source=f"--methods {name}")
    return methods

