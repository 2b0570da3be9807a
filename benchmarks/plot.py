"""Plot (PNG) and tabulate (Markdown) result files of `python -m benchmarks.run`.

    python -m benchmarks.plot                          # benchmarks/results/*.json -> PNG
    python -m benchmarks.plot R1.json R2.json --out /tmp/gdn.png --markdown

One panel per file and op: each arm's median of group medians in ms (from the file's timed
calls; a tick at its device time where the file has one, `*` where the group medians spread more
than 5%), the floor as a dashed line. The PNG goes
to `--out` (default under the runner's result folder, outside the source tree). `--markdown`
prints one table per file: median ms per op and the ratio to `--baseline`.

Needs matplotlib for the PNG (not a dependency of the package or its tests).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from benchmarks.run import default_out_dir, summarize

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# arm base name -> (label, colour); other arms get grey
ARMS = {
    "cuda": ("jax-cake-gdn cuda", "#d62728"),
    "base": ("jax-cake-gdn cuda, baseline revision", "#ff7f0e"),
    "xla": ("jax-cake-gdn xla", "#ff9896"),
    "kcp": ("jax-cake-gdn gdn_kcp", "#9467bd"),
    "flashqla": ("FlashQLA (torch)", "#1f77b4"),
    "fla": ("FLA (torch)", "#aec7e8"),
}
OTHER_COLOUR = "#7f7f7f"
CAP = 4.0  # a panel's axis ends near CAP x its fastest arm


def label(arm: str) -> str:
    """`cuda:full:det` -> `jax-cake-gdn cuda (full, det)`."""
    base, *opts = arm.split(":")
    return ARMS.get(base, (base,))[0] + (f" ({', '.join(opts)})" if opts else "")


def colour(arm: str) -> str:
    return ARMS.get(arm.split(":")[0], (None, OTHER_COLOUR))[1]


@dataclass
class Cell:
    median_ms: float
    device_ms: Optional[float] = None
    spread_flag: bool = False


@dataclass
class Run:
    """One result file: {op: {arm: Cell}} and what it ran on."""

    path: str
    workload: str
    title: str
    shape: str
    note: str
    cells: Dict[str, Dict[str, Cell]] = field(default_factory=dict)
    floor_ms: Dict[str, float] = field(default_factory=dict)


def load(path: str) -> Run:
    with open(path) as f:
        d = json.load(f)
    w = d["workload"]
    docs = "/".join(str(x) for x in w["doc_lens"])
    kv = f"K=V={w['K']}" if w["K"] == w["V"] else f"K={w['K']}, V={w['V']}"
    run = Run(path=path, workload=w["name"],
              shape=f"T={w['T']}, {len(w['doc_lens'])} doc(s), (H, HV)=({w['H']}, {w['HV']}), {kv}",
              title=f"{w['name']}: T={w['T']} in {len(w['doc_lens'])} doc(s) {docs}, "
                    f"(H, HV)=({w['H']}, {w['HV']}), {kv}",
              note=f"{d['device']['kind']}, jax {d['versions']['jax']}, {d['timestamp'][:10]}"
                   + ("" if d.get("complete", True) else " (incomplete run)"))
    for r in d["results"]:
        s = summarize(r["times_ms"])  # the same statistics for files of every schema
        run.cells.setdefault(r["op"], {})[r["arm"]] = Cell(s["median_ms"], r.get("device_ms"),
                                                           s["spread_flag"])
    run.floor_ms = {op: f["ms"] for op, f in d.get("floor", {}).items()}
    return run


def markdown(runs: List[Run], baseline: Optional[str] = "flashqla") -> str:
    """One table per run: median ms per arm and op, and the ratio baseline / arm."""
    out = []
    for run in runs:
        ops = list(run.cells)
        arms = list(dict.fromkeys(a for op in ops for a in run.cells[op]))
        base = baseline if baseline and any(baseline in run.cells[op] for op in ops) else None
        out.append(f"{run.title} ({run.note})\n")
        hdr = "| arm | " + " | ".join(f"{op} ms" for op in ops) + " |"
        if base:
            hdr += " " + " | ".join(f"{op} x {base}" for op in ops) + " |"
        out += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
        for a in arms:
            cells = [run.cells[op].get(a) for op in ops]
            row = f"| {label(a)} | " + " | ".join(
                "-" if c is None else f"{c.median_ms:.2f}" + ("*" if c.spread_flag else "")
                for c in cells) + " |"
            if base:
                row += " " + " | ".join(
                    "-" if c is None or base not in run.cells[op] else
                    f"{run.cells[op][base].median_ms / c.median_ms:.2f}"
                    for c, op in zip(cells, ops)) + " |"
            out.append(row)
        out.append("| floor | " + " | ".join(
            f"{run.floor_ms[op]:.2f}" if op in run.floor_ms else "-" for op in ops) + " |"
            + (" " + " | ".join("" for _ in ops) + " |" if base else ""))
        out.append("")
    return "\n".join(out)


def plot(runs: List[Run], out: str) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks.plot needs matplotlib for the PNG: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(run, op) for run in runs for op in run.cells]
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    height = max(3.0, 0.35 * max(len(run.cells[op]) for run, op in panels) + 1.2)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, height * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (run, op) in zip(axes.flat, panels):
        cells = run.cells[op]
        arms = sorted(cells, key=lambda a: cells[a].median_ms)
        ms = [cells[a].median_ms for a in arms]
        cap = min(max(ms), CAP * min(ms))  # far slower arms run off the edge, value written
        bars = ax.barh([label(a) for a in arms], [min(x, cap * 1.2) for x in ms],
                       color=[colour(a) for a in arms])
        for b, a in zip(bars, arms):
            c, y = cells[a], b.get_y() + b.get_height() / 2
            ax.text(min(c.median_ms, cap * 1.2), y, f" {c.median_ms:.2f}"
                    + ("*" if c.spread_flag else "") + (" >" if c.median_ms > cap else ""),
                    va="center", fontsize=7)
            if c.device_ms is not None:
                ax.plot([c.device_ms] * 2, [b.get_y(), b.get_y() + b.get_height()], color="k",
                        lw=1.2)
        if op in run.floor_ms:
            ax.axvline(run.floor_ms[op], color="k", ls="--", lw=0.8)
        ax.set_xlim(0, cap * 1.3)
        ax.invert_yaxis()
        ax.set_xlabel("ms per call (lower is better)", fontsize=8)
        ax.set_title(f"{run.workload} {op}\n{run.shape}", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.tick_params(axis="x", labelsize=7)
    notes = "; ".join(dict.fromkeys(r.note for r in runs))
    fig.suptitle("Gated DeltaNet (packed documents, q/k L2 norm), one process per file; dashed: "
                 "floor; black tick: device time; *: group-median spread above 5%\n" + notes,
                 fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    print(f"wrote {out}", file=sys.stderr)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def main(argv=None) -> List[Run]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                formatter_class=_Help)
    p.add_argument("json", nargs="*", help="result files (none: benchmarks/results/*.json)")
    p.add_argument("--out", default=os.path.join(default_out_dir(), "gdn.png"),
                   help="PNG path (empty string: no PNG)")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables to stdout")
    p.add_argument("--baseline", default="flashqla",
                   help="arm of the ratio columns (empty string: none)")
    a = p.parse_args(argv)
    files = a.json or sorted(glob.glob(os.path.join(RESULTS, "*.json")))
    if not files:
        p.error(f"no result files given and none in {RESULTS}")
    runs = [load(f) for f in files]
    if a.markdown:
        print(markdown(runs, a.baseline or None))
    if a.out:
        plot(runs, a.out)
    return runs


if __name__ == "__main__":
    main()
