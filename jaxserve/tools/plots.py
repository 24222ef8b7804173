"""Small plotting helpers for reports and benchmarks (matplotlib, Agg, no pyplot global state).

Every figure is written as a bundle: ``<stem>.png``, ``<stem>.svg`` and ``<stem>.csv`` holding the
plotted data, so a number in a plot can always be checked against its table.

    fig, ax = new_figure()
    ax.plot(...)
    paths = save_bundle(fig, out_dir, "stem", header, rows)
"""

from __future__ import annotations

import csv
import os
import sys
from typing import Any, Sequence

from jaxserve.tools import require

matplotlib = require("matplotlib")
if "matplotlib.pyplot" not in sys.modules:  # headless default; we never use pyplot ourselves
    matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

__all__ = ["new_figure", "write_csv", "save_figure", "save_bundle", "line_plot",
           "plot_kv_gib_vs_context", "plot_tail_waste_vs_page_size", "format_tokens"]


def new_figure(width: float = 7.0, height: float = 4.5, dpi: int = 120) -> tuple[Figure, Any]:
    """A standalone figure (Agg canvas) with one grid-lined axes."""
    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(True, which="major", alpha=0.35)
    return fig, ax


def write_csv(path: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(header))
        w.writerows([list(r) for r in rows])
    return path


def save_figure(fig: Figure, out_dir: str, stem: str,
                formats: Sequence[str] = ("png", "svg")) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for fmt in formats:
        path = os.path.join(out_dir, f"{stem}.{fmt}")
        fig.savefig(path, format=fmt)
        paths[fmt] = path
    return paths


def save_bundle(fig: Figure, out_dir: str, stem: str, header: Sequence[str],
                rows: Sequence[Sequence[Any]]) -> dict[str, str]:
    """Write ``stem.png``, ``stem.svg`` and ``stem.csv``; return their paths by extension."""
    paths = save_figure(fig, out_dir, stem)
    paths["csv"] = write_csv(os.path.join(out_dir, f"{stem}.csv"), header, rows)
    return paths


def format_tokens(x: float, _pos: Any = None) -> str:
    """128 -> '128', 4096 -> '4K', 131072 -> '128K'."""
    if x >= 1024 and x % 1024 == 0:
        return f"{int(x) // 1024}K"
    return f"{x:g}"


def line_plot(out_dir: str, stem: str, x: Sequence[float], series: dict[str, Sequence[float]], *,
              title: str, xlabel: str, ylabel: str, logx: bool = False, logy: bool = False,
              header: Sequence[str] | None = None, rows: Sequence[Sequence[Any]] | None = None,
              marker: str = "o") -> dict[str, str]:
    """One x axis, several named series; the CSV defaults to x plus one column per series."""
    fig, ax = new_figure()
    for name, ys in series.items():
        ax.plot(x, ys, marker=marker, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log", base=2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if len(series) > 1:
        ax.legend()
    if header is None or rows is None:
        header = [xlabel] + list(series)
        rows = [[xi] + [series[s][i] for s in series] for i, xi in enumerate(x)]
    return save_bundle(fig, out_dir, stem, header, rows)


def plot_kv_gib_vs_context(out_dir: str, header: Sequence[str], rows: Sequence[Sequence[Any]],
                           stem: str = "kv_gib_vs_context") -> dict[str, str]:
    """Plot (1): KV GiB of one sequence vs retained context, one line per architecture.

    ``header, rows`` as returned by ``jaxserve.tools.kv_budget.gib_vs_context``.
    """
    fig, ax = new_figure()
    x = [r[0] for r in rows]
    markers = "osD^vP*X"
    styles = ("-", "--", "-.", ":")
    for j, col in enumerate(header[1:], start=1):
        name = col[:-4] if col.endswith("_gib") else col
        ax.plot(x, [r[j] for r in rows], marker=markers[(j - 1) % len(markers)], markersize=4,
                linestyle=styles[(j - 1) % len(styles)], label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(format_tokens))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:.3g}"))
    ax.set_title("KV cache memory of one sequence vs retained context")
    ax.set_xlabel("retained context (tokens, log scale)")
    ax.set_ylabel("KV cache (GiB, log scale)")
    ax.legend(title="architecture (KV dtype)", fontsize="small")
    return save_bundle(fig, out_dir, stem, header, rows)


def plot_tail_waste_vs_page_size(out_dir: str, header: Sequence[str],
                                 rows: Sequence[Sequence[Any]], reserve_waste: float,
                                 *, reserve: int, distribution: str,
                                 highlight: Sequence[int] = (),
                                 stem: str = "tail_waste_vs_page_size") -> dict[str, str]:
    """Plot (2): exact mean tail waste per request vs page size, with the fixed reservation's mean
    waste as a horizontal reference line and the (B-1)/2 guide.

    ``header, rows, reserve_waste`` as returned by ``jaxserve.tools.kv_budget.tail_waste_vs_page_size``.
    """
    fig, ax = new_figure()
    b = [r[0] for r in rows]
    ax.plot(b, [r[3] for r in rows], linestyle=":", color="grey", label="(B-1)/2: exact mean for uniform 1..M when B divides M")
    ax.plot(b, [r[1] for r in rows], marker="o", color="C0",
            label=f"paged, exact mean ({distribution})")
    ax.axhline(float(reserve_waste), color="C3", linestyle="--",
               label=f"fixed reservation of {reserve} slots: {float(reserve_waste):g}")
    for k, row in enumerate(r for r in rows if r[0] in highlight):
        ax.plot([row[0]], [row[1]], marker="o", markersize=9, markerfacecolor="none",
                color="C1")
        ax.annotate(f"B={row[0]}: {row[1]:.4g}", (row[0], row[1]), xytext=(-8, 10 + 14 * (k % 2)),
                    textcoords="offset points", ha="right", fontsize="small", color="C1")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(format_tokens))
    ax.set_xticks([v for v in b if v & (v - 1) == 0] or b)  # powers of two, labels never collide
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_title("Mean KV tail waste per request vs page size")
    ax.set_xlabel("page size B (slots = tokens per page, log scale)")
    ax.set_ylabel("mean tail waste (slots per request)")
    top = max([float(reserve_waste)] + [r[1] for r in rows] + [r[3] for r in rows])
    ax.set_ylim(0, top * 1.1 + 1)
    ax.legend(fontsize="small", loc="center left")
    csv_header = list(header) + ["reserve", "reserve_mean_waste"]
    csv_rows = [list(r) + [reserve, float(reserve_waste)] for r in rows]
    return save_bundle(fig, out_dir, stem, csv_header, csv_rows)
