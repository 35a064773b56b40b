"""The ``specdec`` command line: ``generate``, ``serve``, ``demo``, ``bench``, ``chat``, ``cluster`` and ``plugins``,
plus the commands plugins add (``train-mtp``, the mtp plugin's).

Bad input of any kind ends with one line on stderr (``error: ...``) and exit code 2; ``--debug``
shows the traceback instead, and logs what the engine chose (kernels, attention backend, weights).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from .errors import RequestError, SpecdecError

EXIT_USAGE = 2


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default: the flag's own when its help does not already
    say it (most engine flags default to None here and name the engine's default in words)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if action.default is None or action.default == []:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2, and every flag's help shows its
    default (:class:`HelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}\n")


def _version_line() -> str:
    from importlib import metadata

    from . import __version__

    try:
        paddle = metadata.version("paddlepaddle")
    except metadata.PackageNotFoundError:
        try:
            paddle = metadata.version("paddlepaddle-gpu")
        except metadata.PackageNotFoundError:
            paddle = "not installed"
    return f"specdec {__version__} (paddle-specdec; paddle {paddle}; Python {sys.version.split()[0]})"


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("positional_model", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model takes it (`specdec serve MODEL`, as vLLM and llama-server take it)")
    model.add_argument("--model", default=None,
                       help="a GGUF file (recognised by its magic bytes), a Hugging Face checkpoint directory, "
                            "or an alias (default: smollm2-135m-instruct)")
    model.add_argument("--config", default=None, metavar="FILE.yaml", help="engine and speculative settings")
    model.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="the longest prompt plus answer (default: the model's context length)")
    model.add_argument("--kernels", default=None,
                       help="auto (default), cpu (the CPU kernels), triton (GPU) or paddle (reference)")
    model.add_argument("--dtype", default=None,
                       help="weight storage: auto (default: float16 with the CPU kernels), float32 or float16")
    model.add_argument("--quantization", default=None,
                       help="weight-only quantization: auto (default: gguf for a quantized GGUF file), none, "
                            "wint8, wint4 or gguf (compute on the file's blocks as stored)")
    model.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                       help="split the model over N ranks, one process each (default 1; docs/deployment.md)")
    model.add_argument("--tensor-parallel-timeout", type=float, default=None, metavar="SECONDS",
                       help="how long a step waits on the other ranks before the engine gives up (default 30)")

    speculation = parser.add_argument_group("speculation (docs/methods.md)")
    speculation.add_argument("--speculative-config", default=None, metavar="JSON",
                             help='speculative settings as JSON, or @file.json, e.g. \'{"method": "ngram"}\' '
                                  "(default: none, plain decoding)")

    batching = parser.add_argument_group("batching and KV cache (docs/batching.md)")
    batching.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                          help="requests run at once (batch size, default 256)")
    batching.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                          help="token rows per step (default 2048); longer prompts are prefilled in chunks")
    batching.add_argument("--attention-backend", default=None,
                          help="auto (default), cpu, triton or paddle")
    batching.add_argument("--block-size", type=int, default=None, metavar="N",
                          help="positions per KV cache block (default 16)")
    batching.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                          help="KV cache blocks (default: from --kv-cache-memory-gb)")
    batching.add_argument("--kv-cache-memory-gb", type=float, default=None, metavar="GIB",
                          help="KV cache budget in GiB (default 4)")
    batching.add_argument("--kv-cache-dtype", default=None,
                          help="cached keys and values: auto (default: float16 with the cpu attention backend), "
                               "float32, float16 or bfloat16 (triton backend)")
    batching.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                          help="share the KV blocks of common prompt prefixes (default on)")
    batching.add_argument("--max-stop-strings", type=int, default=None, metavar="N",
                          help="the most stop strings a request may give (default 16)")
    batching.add_argument("--max-stop-string-length", type=int, default=None, metavar="CHARS",
                          help="the most characters of one stop string (default 256)")

    output = parser.add_argument_group("diagnostics")
    output.add_argument("--debug", action="store_true", help="show tracebacks, and what the engine chose")
    output.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars (default: shown)")


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N", help="tokens to generate at most")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 is all")
    sampling.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    sampling.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    sampling.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0 is off (OpenAI's)")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; 0 is off (OpenAI's)")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 is off (vLLM's)")
    sampling.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]; 0 is off")
    sampling.add_argument("--logprobs", type=int, default=None, metavar="N",
                          help="each generated token's log-probability and the N likeliest (0-20) in the JSON "
                               "output (default: none)")
    sampling.add_argument("--prediction", default=None, metavar="TEXT",
                          help="the output you expect, or @FILE: drafted from for each prompt (Predicted "
                               "Outputs; the output stays the model's own)")


def build_parser() -> argparse.ArgumentParser:
    from .bench_cli import add_bench_flags
    from .chat_cli import add_chat_flags
    from .cluster.flags import add_scheduler_flags
    from .plugin_manager import get_plugins, register_commands
    from .plugins_cli import add_plugins_subcommand

    parser = ArgumentParser(prog="specdec", description="Speculative decoding for Llama-family models.")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    gen = sub.add_parser("generate", help="generate text for prompts")
    _add_engine_flags(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts-file", help='a JSON list of strings, or JSONL with a "prompt" key')
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="send prompts through the chat template (default: when the model has one)")
    _add_sampling_flags(gen, max_tokens=128)
    gen.add_argument("--output", choices=("text", "json"), default="text", help="text, or one JSON document")
    gen.set_defaults(func=run_generate)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/server.md)")
    _add_engine_flags(serve)
    _add_serve_flags(serve)
    _add_cluster_flags(serve)
    serve.set_defaults(func=run_serve)

    demo = sub.add_parser("demo", help="the main job: every built-in method vs plain decoding on a code-edit prompt")
    _add_engine_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=128, help="tokens per method")
    demo.set_defaults(func=run_demo)

    bench = sub.add_parser("bench", help="latency and throughput of methods, in-process or against a server "
                                         "(--base-url); a table, results.json and plots (docs/benchmarks.md)")
    _add_engine_flags(bench)
    add_bench_flags(bench)
    bench.set_defaults(func=run_bench)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal, with tokens/s and acceptance "
                                       "after each answer (docs/server.md)")
    _add_engine_flags(chat)
    add_chat_flags(chat)
    chat.set_defaults(func=run_chat)

    cluster = sub.add_parser("cluster", help="a cluster of serve instances (docs/deployment.md)")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True, parser_class=ArgumentParser)
    status = cluster_sub.add_parser("status", help="the instances of a cluster, their roles and load")
    status.add_argument("--scheduler", required=True, metavar="redis://HOST:PORT/DB", help="the cluster's Redis")
    add_scheduler_flags(status, fastdeploy=False)
    status.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                        help="check the registrations' signatures with this secret (default: "
                             "$SPECDEC_CLUSTER_SECRET; without one, they are shown unchecked)")
    status.add_argument("--output", choices=("text", "json"), default="text", help="text, or JSON")
    status.set_defaults(func=run_cluster_status)

    add_plugins_subcommand(sub)
    register_commands(get_plugins(), sub)  # the plugins' own commands (train-mtp is the mtp plugin's)
    return parser



def _add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """The server's own flags, in titled groups (``specdec serve --help`` lists them apart from
    the engine's): listening, security, limits and timeouts, sampling defaults, logging and metrics."""
    server = serve.add_argument_group("server (docs/server.md)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    server.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    server.add_argument("--enable-docs", action="store_true",
                        help="serve /docs, /redoc and /openapi.json (default: off, 404)")

    security = serve.add_argument_group("security (docs/deployment.md#security)")
    security.add_argument("--api-key", default=None,
                          help="require 'Authorization: Bearer KEY' on /v1/ requests (default: $SPECDEC_API_KEY; "
                               "prefer that: a flag is visible to every user in ps)")
    security.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                          help="comma-separated names the Host header may give (any port; '*.example.com', '*' "
                               "for any); others get 421, which stops DNS rebinding (default: on loopback "
                               "localhost,127.0.0.1,[::1]; elsewhere *)")
    security.add_argument("--metrics-require-key", action="store_true",
                          help="/metrics needs the API key too (default: open, like /health)")
    security.add_argument("--hide-speculative-usage", action="store_true",
                          help="leave usage.speculative out of responses (acceptance figures tell how much a "
                               "request matched earlier ones; docs/deployment.md#security)")

    limits = serve.add_argument_group("limits and timeouts (docs/server.md#server-limits)")
    limits.add_argument("--max-pending-requests", type=int, default=None, metavar="N",
                        help="requests in flight (running or waiting) before new ones get 503 (default 1024)")
    limits.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                        help="the largest request body; a larger one gets 413 (default 4194304, 4 MiB)")
    limits.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                        help="the longest prompt in characters, checked before tokenizing; a longer one gets 400 "
                             "(default: the context length times the longest token, 663552 for the default model)")
    limits.add_argument("--max-connections", type=int, default=None, metavar="N",
                        help="open connections; a request on one beyond them gets 503 (default 2048)")
    limits.add_argument("--read-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long a client may take to send a request head, and pause while sending a "
                             "body; then 408 and the connection closes (default 10)")
    limits.add_argument("--body-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long after its head a request's whole body may take to arrive, however "
                             "steadily it trickles; then 408 (default 60)")
    limits.add_argument("--send-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long a client may leave its response unread (the socket's buffers full); then "
                             "the connection is cut and its request aborted (default 30)")
    limits.add_argument("--step-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long one engine step may run; past it (a plugin that hangs) the requests in "
                             "flight fail and /health answers 503 until the step returns; 0 turns the "
                             "watchdog off (default 300)")
    limits.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS",
                        help="on SIGINT/SIGTERM, how long requests in flight may finish (default 5)")

    defaults = serve.add_argument_group("sampling defaults (docs/server.md#sampling-defaults)")
    defaults.add_argument("--generation-config", default="auto", metavar="auto|none|PATH",
                          help="the sampling values of the fields a request leaves out: auto (the checkpoint's "
                               "generation_config.json; for a GGUF, llama.cpp's defaults: temperature 0.8, top_k "
                               "40, top_p 0.95, min_p 0.05), none (temperature 1, no top-k/top-p), or a "
                               "generation_config.json file or folder (default auto; as vLLM has it)")
    defaults.add_argument("--override-generation-config", default=None, metavar="JSON",
                          help='set single values over --generation-config, e.g. \'{"temperature": 0.5}\' '
                               "(keys: temperature, top_p, top_k, min_p, repetition_penalty)")

    logs = serve.add_argument_group("logging and metrics (docs/server.md#metrics)")
    logs.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                      help="the log level of the server and of specdec's own loggers (engine, cluster, "
                           "plugins; a stats line every 10 s while busy at info)")
    logs.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                      help="also serve /metrics on this port of --host, alone (FastDeploy's flag; default: none)")


def _add_cluster_flags(serve: argparse.ArgumentParser) -> None:
    from .cluster.flags import add_scheduler_flags

    group = serve.add_argument_group("cluster (docs/deployment.md)")
    group.add_argument("--scheduler", default=None, metavar="redis://HOST:PORT/DB",
                       help="join the cluster this Redis coordinates (rediss:// for TLS; default: serve alone)")
    add_scheduler_flags(group)
    group.add_argument("--role", "--splitwise-role", dest="role", default="mixed",
                       help="mixed (whole requests, default), prefill (prompts, then hand-off) or decode "
                            "(continues handed-off requests)")
    group.add_argument("--instance-id", default=None, help="this instance's name in the cluster "
                                                           "(default ADVERTISE_HOST:PORT)")
    group.add_argument("--advertise-host", default=None,
                       help="the address other instances reach this one at (default: --host, or this machine's "
                            "address when --host is 0.0.0.0)")
    group.add_argument("--kv-transfer-port", type=int, default=0, metavar="PORT",
                       help="a decode instance's port for KV hand-offs (default 0: any free port)")
    group.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                       help="a file whose first line is the secret the instances share (signs hand-offs, "
                            "registrations and jobs; required for prefill/decode roles off loopback)")
    group.add_argument("--cluster-secret", default=None, metavar="SECRET",
                       help="the cluster secret itself (default: $SPECDEC_CLUSTER_SECRET; prefer that or "
                            "--cluster-secret-file: a flag is visible to every user in ps)")
    group.add_argument("--kv-transfer-tls-cert", default=None, metavar="PATH",
                       help="TLS on the KV transfer channel: this instance's certificate (PEM; with "
                            "--kv-transfer-tls-key; the same flags on every instance)")
    group.add_argument("--kv-transfer-tls-key", default=None, metavar="PATH", help="its private key (PEM)")
    group.add_argument("--kv-transfer-tls-ca", default=None, metavar="PATH",
                       help="the CA that signs the instances' certificates (default: the system's); decode "
                            "instances then require a client certificate too")


# -- shared helpers --------------------------------------------------------------------------


def build_engine_config_from_args(args, plugins):
    """The engine config of the engine flags, ``--config`` and ``--speculative-config``."""
    from .config import ENGINE_KEYS, build_engine_config, load_yaml_file, parse_json_text

    yaml_data = load_yaml_file(args.config) if args.config else None
    overrides = {key: getattr(args, key, None) for key in ENGINE_KEYS}
    overrides["seed"] = None  # --seed is the sampling seed of the requests
    spec_data = parse_json_text(args.speculative_config) if args.speculative_config else None
    config = build_engine_config(yaml_data, overrides, spec_data, plugins)
    for notice in config.speculative.notices:
        print(f"notice: {notice}", file=sys.stderr)
    return config


def _warn_plugin_errors(plugins) -> None:
    for message in plugins.errors:
        print(f"warning: {message}", file=sys.stderr)


#: The flag of each sampling field, for error messages (``--top-k: must be ...``).
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                  "top_k": "--top-k", "seed": "--seed", "stop": "--stop", "presence_penalty": "--presence-penalty",
                  "frequency_penalty": "--frequency-penalty", "repetition_penalty": "--repetition-penalty",
                  "min_p": "--min-p", "logprobs": "--logprobs", "prediction": "--prediction"}


def as_flag_error(exc: RequestError) -> SpecdecError:
    """A request error worded for the command line: the field replaced by its flag."""
    flag = SAMPLING_FLAGS.get(exc.param)
    return SpecdecError(f"{flag}: {exc.problem}") if flag else exc


def sampling_from_args(args):
    from .sampling import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                              ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                              min_p=args.min_p, logprobs=args.logprobs)
    except RequestError as exc:
        raise as_flag_error(exc) from None


def read_prediction(value: str | None) -> str | None:
    """``--prediction``: the text itself, or ``@FILE``'s contents."""
    if value is None or not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        return path.read_text()
    except OSError as exc:
        raise SpecdecError(f"--prediction: cannot read {path}: {exc.strerror}") from None


def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts_file)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecdecError(f"--prompts-file: cannot read {path}: {exc.strerror}") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecdecError(f"--prompts-file: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    else:
        prompts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecdecError(f"--prompts-file: line {number}: invalid JSON at column {exc.colno}: {exc.msg}") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise SpecdecError(f'--prompts-file: line {number}: expected an object with a "prompt" key')
            prompts.append(record["prompt"])
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise SpecdecError("--prompts-file: expected a non-empty list of strings")
    return prompts


# -- commands --------------------------------------------------------------------------------


def run_generate(args) -> int:
    from .api import LLM
    from .metrics import SpecMetrics
    from .plugin_manager import get_plugins

    plugins = get_plugins()
    _warn_plugin_errors(plugins)
    config = build_engine_config_from_args(args, plugins)
    if _run_as_worker(config):
        return 0
    sampling = sampling_from_args(args)
    prompts = read_prompts(args)
    prediction = read_prediction(args.prediction)
    llm = LLM(config=config, plugins=plugins, progress=args.progress)
    if prediction:
        import attrs

        sampling = attrs.evolve(sampling, prediction=llm.tokenizer.encode(prediction, add_special_tokens=False))
    use_chat = llm.tokenizer.has_chat_template if args.chat is None else args.chat
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, sampling, use_chat_template=use_chat, progress=args.progress)
    except RequestError as exc:  # checked against the engine: top_k within the vocabulary, the context
        raise as_flag_error(exc) from None
    finally:
        llm.engine.close()
    elapsed = time.perf_counter() - start
    total_tokens = sum(o.num_generated_tokens for o in outputs)
    metrics = SpecMetrics.total(o.metrics for o in outputs)
    summary = {
        "num_generated_tokens": total_tokens,
        "elapsed_s": round(elapsed, 4),
        "tokens_per_s": round(total_tokens / elapsed, 3) if elapsed > 0 else 0.0,
        "decode_tokens_per_s": round(_decode_tokens_per_s(outputs, elapsed), 3),
        "metrics": metrics.to_dict(),
        "engine": _engine_summary(llm.engine),
    }
    if args.output == "json":
        results = [o.to_dict() for o in outputs]
        if sampling.logprobs is not None:
            for result, output in zip(results, outputs):
                result["logprobs"] = [{"token_id": e.token_id, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                                      for e in output.logprobs or ()]
        json.dump({"results": results, "summary": summary}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for output in outputs:
            print(output.text)
            if len(outputs) > 1:
                print("-" * 40)
        print(_summary_line(summary), file=sys.stderr)
    return 0


def _decode_tokens_per_s(outputs, elapsed: float) -> float:
    """Decode speed, prefill left out: the tokens after each request's first one, per second
    from the first request's first token to the end (one request: its own decode speed)."""
    started = [o.first_token_s for o in outputs if o.num_generated_tokens > 0]
    decode_time = elapsed - min(started) if started else 0.0
    decode_tokens = sum(max(o.num_generated_tokens - 1, 0) for o in outputs)
    return decode_tokens / decode_time if decode_time > 0 else 0.0


def _engine_summary(engine) -> dict:
    """What the engine resolved its ``auto`` settings to (``--output json``'s ``summary.engine``):
    which kernels and attention backend ran, the weights' dtype and quantization, the KV cache's
    dtype. Scripts check it to know what they measured (``kernels: cpu``: the native CPU kernels)."""
    return {"kernels": engine.kernels, "attention_backend": engine.attention_backend,
            "weight_dtype": engine.weight_dtype, "quantization": engine.quantization,
            "kv_cache_dtype": engine.kv_cache_dtype}


def _summary_line(summary: dict) -> str:
    m = summary["metrics"]
    return (f"{summary['num_generated_tokens']} tokens in {summary['elapsed_s']:.2f} s "
            f"({summary['tokens_per_s']:.1f} tokens/s), mean acceptance length "
            f"{m['mean_acceptance_length']:.2f}, acceptance rate {m['acceptance_rate']:.2f}")


def _check_range(flag: str, value, low, high=None) -> None:
    if value is not None and (value < low or (high is not None and value > high)):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise SpecdecError(f"{flag}: must be {bounds}, got {value}")


def run_serve(args) -> int:
    from .engine import Engine
    from .plugin_manager import get_plugins
    from .server import serve

    _check_range("--port", args.port, 0, 65535)
    _check_range("--max-pending-requests", args.max_pending_requests, 1)
    _check_range("--shutdown-timeout", args.shutdown_timeout, 0)
    if args.step_timeout is not None and not args.step_timeout >= 0:  # NaN too
        raise SpecdecError(f"--step-timeout: must be >= 0 (0: no watchdog), got {args.step_timeout:g}")
    _check_range("--metrics-port", args.metrics_port, 1, 65535)
    limits = _server_limits(args)
    allowed_hosts = None
    if args.allowed_hosts is not None:
        from .server.hosts import parse_allowed_hosts

        allowed_hosts = parse_allowed_hosts(args.allowed_hosts)
    api_key = args.api_key or os.environ.get("SPECDEC_API_KEY") or None
    if args.metrics_require_key and not api_key:
        raise SpecdecError("--metrics-require-key: needs an API key (--api-key, or $SPECDEC_API_KEY)")
    if args.api_key:
        print("warning: --api-key: the key is visible to every user of this machine (ps, /proc); "
              "set SPECDEC_API_KEY instead", file=sys.stderr)
    cluster_options = _cluster_options(args, api_key)
    generation_override = None
    if args.override_generation_config is not None:
        try:
            generation_override = json.loads(args.override_generation_config)
        except ValueError as exc:
            raise SpecdecError(f"--override-generation-config: not valid JSON: {exc}") from None
    plugins = get_plugins()
    _warn_plugin_errors(plugins)
    config = build_engine_config_from_args(args, plugins)
    if _run_as_worker(config):
        return 0
    from .server.generation_defaults import load_generation_defaults

    generation_defaults = load_generation_defaults(config.model, args.generation_config, generation_override)
    sock = serve.bind_socket(args.host, args.port)  # before the model loads: a taken port fails now
    metrics_sock = None
    if args.metrics_port is not None:
        metrics_sock = serve.bind_socket(args.host, args.metrics_port, "--metrics-port")
    engine = Engine(config, plugins=plugins, progress=args.progress)
    try:
        serve.run_server(
            engine, sock,
            served_model_name=args.served_model_name or config.model,
            api_key=api_key,
            max_pending=args.max_pending_requests or serve.DEFAULT_MAX_PENDING,
            shutdown_timeout=serve.DEFAULT_SHUTDOWN_TIMEOUT if args.shutdown_timeout is None else args.shutdown_timeout,
            step_timeout=serve.DEFAULT_STEP_TIMEOUT if args.step_timeout is None else args.step_timeout,
            limits=limits, enable_docs=args.enable_docs, metrics_require_key=args.metrics_require_key,
            allowed_hosts=allowed_hosts, log_level=args.log_level, metrics_sock=metrics_sock,
            hide_speculative_usage=args.hide_speculative_usage, generation_defaults=generation_defaults,
            join_cluster=_cluster_joiner(cluster_options, args.served_model_name or config.model),
        )
    finally:
        engine.close()
    return 0


def _cluster_joiner(cluster_options, served_model_name: str):
    """What ``run_server`` calls to join the cluster (None without one)."""
    if cluster_options is None:
        return None
    from .cluster import Cluster

    def join_cluster(engine_loop, host: str, port: int):
        return Cluster(cluster_options, engine_loop, served_model_name, http_host=host, http_port=port,
                       metrics=engine_loop.metrics)

    return join_cluster


def _cluster_options(args, api_key):
    """The ``ClusterOptions`` of the cluster flags (None without a scheduler); Redis is
    reached once here, before the model loads, so that a wrong address fails at once."""
    from .cluster.flags import scheduler_config

    scheduler = scheduler_config(args)
    if scheduler is None:
        if args.role != "mixed":
            raise SpecdecError(f"--role {args.role}: needs --scheduler (a cluster)")
        return None
    from .cluster import ClusterOptions
    from .cluster.redis_link import ping
    from .cluster.secret import resolve_cluster_secret, secret_required
    from .cluster.transfer import TransferTLS

    if args.cluster_secret:
        print("warning: --cluster-secret: the secret is visible to every user of this machine (ps, /proc); "
              "use --cluster-secret-file or $SPECDEC_CLUSTER_SECRET instead", file=sys.stderr)
    cluster_secret = resolve_cluster_secret(args.cluster_secret, args.cluster_secret_file)
    if cluster_secret is None and secret_required(args.role, args.advertise_host or args.host):
        raise SpecdecError(f"--role {args.role}: on {args.advertise_host or args.host} (not loopback) the instances "
                           "need a shared secret: --cluster-secret-file PATH or $SPECDEC_CLUSTER_SECRET")
    if bool(args.kv_transfer_tls_cert) != bool(args.kv_transfer_tls_key) or (
            args.kv_transfer_tls_ca and not args.kv_transfer_tls_cert):
        raise SpecdecError("--kv-transfer-tls-cert and --kv-transfer-tls-key go together (and --kv-transfer-tls-ca "
                           "with them)")
    tls = None
    if args.kv_transfer_tls_cert:
        tls = TransferTLS(args.kv_transfer_tls_cert, args.kv_transfer_tls_key, args.kv_transfer_tls_ca)
        tls.contexts()  # a bad file fails now, before the model loads
    options = ClusterOptions(scheduler=scheduler, role=args.role, instance_id=args.instance_id,
                             advertise_host=args.advertise_host, kv_transfer_port=args.kv_transfer_port,
                             api_key=api_key, cluster_secret=cluster_secret, transfer_tls=tls)
    ping(options.scheduler)
    if getattr(args, "process_argv", None) is not None:  # the checks passed: now take the password off ps's listing
        from .cluster.flags import hide_password_and_restart

        hide_password_and_restart(args.process_argv, args)  # returns when there is no password to hide
    return options


def run_cluster_status(args) -> int:
    from .cluster.flags import scheduler_config
    from .cluster.secret import resolve_cluster_secret
    from .cluster.status import cluster_status

    return cluster_status(scheduler_config(args), args.output,
                          cluster_secret=resolve_cluster_secret(file=args.cluster_secret_file))


def _run_as_worker(config) -> bool:
    """With tensor parallelism across machines ``paddle.distributed.launch`` starts the command
    on every rank: rank 0 runs it, every other rank serves its slice of the model until rank
    0 stops (True: done)."""
    from .engine.tensor_parallel import launched_rank, worker_loop

    launched = launched_rank()
    if config.tensor_parallel_size <= 1 or launched is None or launched[0] == 0:
        return False
    worker_loop(config)
    return True


def _server_limits(args):
    """The ``ServerLimits`` of the serve flags (their defaults where not given)."""
    from .server import limits

    _check_range("--max-body-bytes", args.max_body_bytes, 1)
    _check_range("--max-prompt-chars", args.max_prompt_chars, 1)
    _check_range("--max-connections", args.max_connections, 1)
    for flag, value in (("--read-timeout", args.read_timeout), ("--body-timeout", args.body_timeout),
                        ("--send-timeout", args.send_timeout)):
        if value is not None and not value > 0:
            raise SpecdecError(f"{flag}: must be > 0, got {value:g}")
    given = {"max_body_bytes": args.max_body_bytes, "max_prompt_chars": args.max_prompt_chars,
             "max_connections": args.max_connections, "read_timeout": args.read_timeout,
             "body_timeout": args.body_timeout, "send_timeout": args.send_timeout}
    return limits.ServerLimits(**{name: value for name, value in given.items() if value is not None})


def run_demo(args) -> int:
    from .demo import run_demo as demo
    from .plugin_manager import get_plugins

    plugins = get_plugins()
    config = build_engine_config_from_args(args, plugins)
    return demo(config, plugins, max_tokens=args.max_tokens, progress=args.progress)


def run_bench(args) -> int:
    from .bench_cli import run_bench as bench

    return bench(args, build_engine_config_from_args)


def run_chat(args) -> int:
    from .chat_cli import run_chat as chat

    return chat(args, build_engine_config_from_args)


def main(argv=None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    positional = getattr(args, "positional_model", None)
    if positional is not None:
        if args.model is not None and args.model != positional:
            parser.exit(EXIT_USAGE, f"error: specdec: the model is named twice: '{positional}' and --model "
                                    f"'{args.model}'\n")
        args.model = positional
    args.process_argv = sys.orig_argv if from_command_line else None  # this process's own command line
    debug = getattr(args, "debug", False) or os.environ.get("SPECDEC_DEBUG") == "1"
    if debug:  # also what the engine decided: kernels, attention backend, weights, cache
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("specdec").setLevel(logging.DEBUG)
    try:
        return args.func(args)
    except SpecdecError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
