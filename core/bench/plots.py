"""The PNG plots of a benchmark (matplotlib, Agg backend: no display needed).

- ``tokens_per_s.png``: median end-to-end and decode tokens/s per method (smallest batch size).
- ``acceptance_per_position.png``: share of drafts whose token i was accepted, per method
  (methods without figures, plain decoding or a server that does not report them, are left out).
- ``batch_scaling.png``: throughput (all tokens / wall time) against batch size, per method.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecdecError
from .results import Summary

INSTALL_HINT = "pip install 'paddle-specdec[bench]'"


def require_matplotlib() -> None:
    """Fail early, in one line that says how to install it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpecdecError(f"the plots need matplotlib: {INSTALL_HINT} (or --no-plots)") from None


def write_plots(summaries: list[Summary], output_dir: Path, title: str) -> list[Path]:
    """Write the three plots into ``output_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in (("tokens_per_s.png", _tokens_per_s), ("acceptance_per_position.png", _acceptance),
                       ("batch_scaling.png", _batch_scaling)):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        draw(axes, summaries)
        axes.set_title(title, fontsize=9)
        figure.tight_layout()
        path = output_dir / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def _methods(summaries: list[Summary]) -> list[str]:
    return list(dict.fromkeys(s.method for s in summaries))


def _tokens_per_s(axes, summaries: list[Summary]) -> None:
    smallest = min(s.batch_size for s in summaries)
    rows = [s for s in summaries if s.batch_size == smallest]
    positions = range(len(rows))
    axes.bar([p - 0.2 for p in positions], [s.median_tokens_per_s for s in rows], width=0.4, label="end to end")
    axes.bar([p + 0.2 for p in positions], [s.median_decode_tokens_per_s for s in rows], width=0.4, label="decode")
    axes.set_xticks(list(positions), [s.method for s in rows])
    axes.set_ylabel(f"tokens/s per request (median, batch {smallest})")
    axes.legend()


def _acceptance(axes, summaries: list[Summary]) -> None:
    longest = 0
    for method in _methods(summaries):
        rows = [s for s in summaries if s.method == method and s.acceptance_per_position]
        if rows:
            rates = rows[0].acceptance_per_position
            axes.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{method} (batch {rows[0].batch_size})")
            longest = max(longest, len(rates))
    if longest:
        axes.set_xticks(range(1, longest + 1))
        axes.legend()
    else:
        axes.text(0.5, 0.5, "no acceptance figures (plain decoding, or not reported by the server)",
                  ha="center", va="center", transform=axes.transAxes)
    axes.set_xlabel("draft position")
    axes.set_ylabel("share of drafts accepted")
    axes.set_ylim(0, 1.05)


def _batch_scaling(axes, summaries: list[Summary]) -> None:
    for method in _methods(summaries):
        rows = sorted((s for s in summaries if s.method == method), key=lambda s: s.batch_size)
        axes.plot([s.batch_size for s in rows], [s.throughput_tokens_per_s for s in rows], marker="o", label=method)
    sizes = sorted({s.batch_size for s in summaries})
    if sizes[-1] >= 8 * sizes[0]:
        axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.set_xlabel("batch size (requests at once)")
    axes.set_ylabel("throughput, tokens/s")
    axes.set_ylim(bottom=0)
    axes.legend()
