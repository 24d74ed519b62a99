"""Tables and plots for benchmark results."""

from __future__ import annotations

from pathlib import Path

COLUMNS = [
    ("concurrency", "conc", "{:d}"),
    ("completed", "ok", "{:d}"),
    ("failed", "failed", "{:d}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("total_token_throughput", "total tok/s", "{:.1f}"),
    ("request_throughput", "req/s", "{:.2f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.1f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.1f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.2f}"),
    ("p99_tpot_ms", "p99 TPOT ms", "{:.2f}"),
    ("mean_itl_ms", "mean ITL ms", "{:.2f}"),
]


def markdown_table(results: list[dict], extra: list[tuple[str, str, str]] = ()) -> str:
    cols = list(COLUMNS) + list(extra)
    if any("label" in r for r in results):
        cols = [("label", "layout", "{}")] + cols
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            try:
                cells.append(fmt.format(v) if v is not None else "—")
            except (ValueError, TypeError):
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_levels(series: dict[str, list[dict]], out_dir: Path, predicted: dict[str, list[dict]] | None = None) -> list[Path]:
    """Output tok/s and TPOT against concurrency, one line per series (layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, ylabel, fname in (("output_throughput", "output tok/s", "throughput.png"), ("mean_tpot_ms", "mean TPOT (ms)", "tpot.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rows in series.items():
            rows = sorted(rows, key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in rows], [r.get(key, float("nan")) for r in rows], marker="o", label=name)
        for name, rows in (predicted or {}).items():
            rows = sorted(rows, key=lambda r: r["concurrency"])
            ax.plot(
                [r["concurrency"] for r in rows],
                [r.get(key, float("nan")) for r in rows],
                linestyle="--",
                marker="x",
                label=f"{name} (predicted)",
            )
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)  # a rate or a time: from zero, so that a small difference looks small
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
