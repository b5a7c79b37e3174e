"""`python -m flame.plot DUMP [DUMP ...] [--out FILE]`: a picture of one or several runs.

Reads every run's ``DUMP/metrics.jsonl`` (one JSON record per log step, written by
``flame.components.metrics``) and draws training loss, validation loss, learning rate,
tokens/s and GPU memory against steps, one line per run. Writes a PNG with matplotlib (the
optional extra ``pip install -e ".[plot]"``); without matplotlib, or with ``--out X.html``, a
self-contained HTML page with inline SVG charts (no scripts, no network).
"""

from __future__ import annotations

import html
import json
import os
import sys

from flame.errors import ConfigError
from flame.utils.cli import CliParser

# (record key, panel title); records of a relaunched run repeat steps: the latest value wins
PANELS = [
    ("loss", "training loss"),
    ("validation/loss", "validation loss"),
    ("lr", "learning rate"),
    ("tokens_per_second", "tokens/s (all ranks)"),
    ("memory_peak_gib", "GPU memory peak (GiB reserved)"),
]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def read_run(dump: str) -> dict[str, list[tuple[int, float]]]:
    """Each panel's (step, value) series of one run, sorted by step."""
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file (is {dump!r} a flame dump folder?)")
    series: dict[str, dict[int, float]] = {key: {} for key, _ in PANELS}
    with open(path) as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue  # a run killed mid-write leaves a partial last line
            raise ConfigError(f"{path}:{n}: not a JSON record") from None
        step = record.get("step")
        for key in series:
            value = record.get(key)
            if isinstance(step, int) and isinstance(value, (int, float)):
                series[key][step] = float(value)
    return {key: sorted(points.items()) for key, points in series.items()}


def run_labels(dumps: list[str]) -> list[str]:
    names = [os.path.basename(os.path.normpath(d)) for d in dumps]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in dumps]


def write_png(runs: dict[str, dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.6 * len(PANELS)), sharex=True)
    for ax, (key, title) in zip(axes, PANELS):
        drawn = False
        for i, (label, series) in enumerate(runs.items()):
            points = series[key]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, label=label, color=COLORS[i % len(COLORS)],
                        marker="o" if len(points) < 3 else None)
                drawn = True
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif len(runs) > 1:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _svg_panel(runs: dict[str, dict], key: str, title: str, width: int = 640, height: int = 220) -> str:
    left, right, top, bottom = 70, 10, 24, 30
    pw, ph = width - left - right, height - top - bottom
    points = [p for series in runs.values() for p in series[key]]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="15" font-size="13">{html.escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    if not points:
        out.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="gray">not recorded</text></svg>')
        return "".join(out)
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - abs(y0) * 0.05 - 1e-12, y1 + abs(y1) * 0.05 + 1e-12

    def sx(x):
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y):
        return top + (y1 - y) / (y1 - y0) * ph

    for frac in (0.0, 0.5, 1.0):  # three value and step ticks
        y = y0 + frac * (y1 - y0)
        out.append(f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#eee"/>')
        x = x0 + frac * (x1 - x0)
        out.append(f'<text x="{sx(x):.1f}" y="{top + ph + 16}" text-anchor="middle">{x:.0f}</text>')
    for i, (label, series) in enumerate(runs.items()):
        color = COLORS[i % len(COLORS)]
        pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in series[key])
        if series[key]:
            out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"><title>{html.escape(label)}</title></polyline>')
            if len(series[key]) < 3:
                out += [f'<circle cx="{sx(s):.1f}" cy="{sy(v):.1f}" r="3" fill="{color}"/>' for s, v in series[key]]
    out.append("</svg>")
    return "".join(out)


def write_html(runs: dict[str, dict], out: str) -> None:
    legend = " ".join(f'<span style="color:{COLORS[i % len(COLORS)]}">&#9632; {html.escape(label)}</span>'
                      for i, label in enumerate(runs))
    panels = "\n".join(f"<div>{_svg_panel(runs, key, title)}</div>" for key, title in PANELS)
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>flame runs</title></head>\n"
            f"<body style=\"font-family:sans-serif\"><h3>flame runs (x: step)</h3><p>{legend}</p>\n{panels}\n</body></html>\n")
    with open(out, "w") as f:
        f.write(page)


def check_out(out: str) -> None:
    """``--out`` names a file in an existing folder, of a type this command writes."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConfigError(f"--out {out!r}: folder {folder!r} does not exist")
    ext = os.path.splitext(out)[1].lower()
    if ext == ".html":
        return
    if not ext:  # matplotlib would add ".png" itself and write another file than the one named
        raise ConfigError(f"--out {out!r}: no file type; end it in .png or .html")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # an HTML page instead (plot says so)
    if ext[1:] not in FigureCanvasBase.get_supported_filetypes():
        raise ConfigError(f"--out {out!r}: matplotlib cannot write {ext} files; end it in .png or .html")


def plot(dumps: list[str], out: str) -> str:
    """Write the picture of ``dumps``; returns the file written (``.html`` when matplotlib is missing)."""
    check_out(out)
    runs = {label: read_run(d) for label, d in zip(run_labels(dumps), dumps)}
    try:
        if not out.endswith(".html"):
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                out = os.path.splitext(out)[0] + ".html"
                print(f"matplotlib is not installed (pip install -e \".[plot]\" for a PNG): writing {out}")
            else:
                write_png(runs, out)
                return out
        write_html(runs, out)
    except OSError as e:
        raise ConfigError(f"--out {out!r}: {e.strerror or e}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = CliParser(prog="python -m flame.plot", description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("dumps", nargs="+", metavar="DUMP", help="dump folders of runs (each holds metrics.jsonl)")
    parser.add_argument("--out", default="flame_runs.png",
                        help="file to write: .png (needs matplotlib; .html without it) or .html (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        written = plot(args.dumps, args.out)
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
