"""``specdec chat``: an interactive chat in the terminal, with the model in this process (or a
server, ``--base-url``). It reads one message a line from stdin, so a script of lines can be
piped in; at a terminal, lines have history (readline: the arrow keys).

Commands: ``/reset`` forgets the conversation, ``/method NAME`` switches the speculative method
(in-process), ``/help``, ``/quit`` (or end of input). Ctrl-C stops an answer; at the prompt it
ends the chat. After each answer one line says its
tokens, tokens/s and what speculation did (``n/a`` when a server does not report it).
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import RequestError, SpecdecError

HELP = "commands: /reset (new conversation), /method NAME (naive, ngram, suffix, ...), /help, /quit"


def add_chat_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``specdec chat`` beyond the engine flags (which ``cli`` adds)."""
    group = parser.add_argument_group("chat")
    group.add_argument("--base-url", default=None, metavar="URL",
                       help="chat with this OpenAI-compatible server instead of an in-process model "
                            "(default: none, in-process); --model then names the served model")
    group.add_argument("--api-key", default=None,
                       help="the server's API key (default: $SPECDEC_API_KEY, else $OPENAI_API_KEY)")
    group.add_argument("--system", default=None, help="a system message that starts every conversation")
    group.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens per answer at most")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")


def stats_line(reply, method: str) -> str:
    """The line after each answer: tokens, speed, acceptance (n/a when unknown), method."""
    length = "n/a" if reply.mean_acceptance_length is None else f"{reply.mean_acceptance_length:.2f}"
    per_position = ("n/a" if reply.accepted_per_position is None
                    else " ".join(f"{p:.2f}" for p in reply.accepted_per_position))
    return (f"[{reply.completion_tokens} tokens, {reply.tokens_per_s:.1f} tokens/s, first token "
            f"{reply.ttft_s:.2f} s, acceptance length {length}, accepted per position {per_position}; "
            f"method {method}]")


def run_chat(args, engine_config_of) -> int:
    """The chat loop; ``engine_config_of(args, plugins)`` builds the in-process engine's config."""
    from .sampling import SamplingParams

    if args.max_tokens < 1:
        raise SpecdecError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except RequestError as exc:
        raise SpecdecError(f"--temperature: {exc.problem}") from None
    backend = _backend(args, engine_config_of)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
        print(f"specdec chat, method {backend.method}. {HELP}")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, argument = line.partition(" ")
            if command in ("/quit", "/exit"):
                break
            if command == "/reset":
                messages = list(start)
                print("(conversation reset)")
            elif command == "/method" and argument.strip():
                try:
                    backend.set_method(argument.strip())
                    print(f"(method {backend.method})")
                except SpecdecError as exc:
                    print(f"error: {exc}")
            else:
                print(HELP)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = backend.answer(messages, sampling, on_text=_show)
        except (RequestError, SpecdecError) as exc:  # the context is full, say: the chat goes on
            messages.pop()
            print(f"error: {exc}")
            continue
        except KeyboardInterrupt:  # Ctrl-C during an answer drops it; at the prompt it ends the chat
            messages.pop()
            print("\n(interrupted)")
            continue
        print()
        print(stats_line(reply, backend.method), flush=True)
        messages.append({"role": "assistant", "content": reply.text})
    return 0


def _show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _backend(args, engine_config_of):
    if args.base_url is not None:
        from .chat import RemoteChat

        api_key = args.api_key or os.environ.get("SPECDEC_API_KEY") or os.environ.get("OPENAI_API_KEY")
        return RemoteChat(args.base_url, api_key, args.model)
    from .api import LLM
    from .chat import LocalChat
    from .plugin_manager import get_plugins

    plugins = get_plugins()
    return LocalChat(LLM(config=engine_config_of(args, plugins), plugins=plugins, progress=args.progress))
