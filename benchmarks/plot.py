"""Plot (PNG) and tabulate (Markdown) benchmark results from benchmarks/results/.

    python -m benchmarks.plot                      # the latest H200 peers run -> the PNG next to it
    python -m benchmarks.plot --markdown           # also print the README's tables
    python -m benchmarks.plot --json R.json ... --log L.log ... --out P.png

Inputs: result JSONs written by `python -m benchmarks.run` (every timed call), and optionally a
run's stderr progress log (`[  57.6s]   fwd: group 1/5 medians ms: cuda 12.222, flashqla 3.407`),
for runs that did not finish and so wrote no JSON. From a log only group medians exist, so its
numbers are the median of the group medians (marked as such).

Needs matplotlib (not a dependency of the package, the tests or CI): `pip install matplotlib`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DEFAULT_JSON = [os.path.join(RESULTS, "B23_2026-11-30b_h200.json"),
                os.path.join(RESULTS, "B23_peers_2026-11-30_h200.json"),
                os.path.join(RESULTS, "B23-layer_2026-11-30_h200.json")]
DEFAULT_LOG: List[str] = []
DEFAULT_OUT = os.path.join(RESULTS, "h200_2026-11-30b.png")

# arm name -> (label, colour); unknown arms get matplotlib's next colour
ARMS = {
    "cuda": ("jax-cake-gdn cuda", "#d62728"),
    "xla": ("jax-cake-gdn xla", "#ff9896"),
    "flashqla": ("FlashQLA 0.1.3 (torch)", "#1f77b4"),
    "fla": ("FLA 0.6.0 (torch)", "#aec7e8"),
    "cuda:full": ("jax-cake-gdn cuda, save_mode full", "#9467bd"),
}
OTHER_COLOUR = "#7f7f7f"


# The cuda backend has forward kernels only (2026-11-29): its backward runs the xla primitives.
CUDA_BWD_NOTE = "\n(cuda fwd, xla bwd)"  # runs whose library had no chunk_bwd kernel yet


@dataclass
class Run:
    """One workload's medians: {op: {arm: median ms}}, plus what is known about it."""

    workload: str
    title: str
    medians: Dict[str, Dict[str, float]] = field(default_factory=dict)
    calls: Dict[str, Dict[str, int]] = field(default_factory=dict)
    floor_ms: Dict[str, float] = field(default_factory=dict)
    note: str = ""
    xla_bwd: bool = False  # the cuda arm's backward ran (mostly) the xla primitives


def _title(name, T, doc_lens, H, HV, K, V, dtype) -> str:
    docs = "/".join(str(x) for x in doc_lens)
    kv = f"K=V={K}" if K == V else f"K={K}, V={V}"
    return f"{name}: T={T} in {len(doc_lens)} document(s) {docs}, (H, HV)=({H}, {HV}), {kv}, {dtype}"


def load_json(path: str) -> Run:
    d = json.load(open(path))
    w = d["workload"]
    run = Run(workload=w["name"],
              title=_title(w["name"], w["T"], w["doc_lens"], w["H"], w["HV"], w["K"], w["V"],
                           w["dtype"]),
              note=f"{d['device']['kind']}, jax {d['versions']['jax']}, {d['timestamp'][:10]}")
    for r in d["results"]:
        run.medians.setdefault(r["op"], {})[r["arm"]] = r["median_ms"]
        run.calls.setdefault(r["op"], {})[r["arm"]] = r["n_calls"]
    run.floor_ms = {op: f["ms"] for op, f in d.get("floor", {}).items()}
    run.xla_bwd = "chunk_bwd" not in d.get("library", {}).get("cuda_kernels", [])
    return run


_HEAD = re.compile(r"device (?P<dev>[^,]+), jax (?P<jax>\S+), workload (?P<wl>\S+) \(T=(?P<T>\d+)\)")
_GROUP = re.compile(r"\s(?P<op>\S+): group (?P<g>\d+)/(?P<n>\d+) medians ms: (?P<rest>.*)$")


def load_log(path: str) -> Run:
    """Group medians from a (possibly unfinished) run's progress log."""
    groups: Dict[str, Dict[str, List[float]]] = {}
    head = None
    for line in open(path):
        m = _HEAD.search(line)
        if m:
            head = m
        m = _GROUP.search(line.rstrip())
        if m:
            for part in m["rest"].split(","):
                arm, ms = part.split()
                groups.setdefault(m["op"], {}).setdefault(arm, []).append(float(ms))
    if head is None:
        raise ValueError(f"{path}: no 'device ..., workload ... (T=...)' line")
    run = Run(workload=head["wl"], title=f"{head['wl']}: T={head['T']}",
              note=f"{head['dev'].replace('gpu:', '')}, jax {head['jax']}, from the progress "
                   "log (median of group medians)")
    try:  # the workload's shape and floors, when it is one of benchmarks.workloads
        from benchmarks import workloads

        w = workloads.get(head["wl"])
        run.title = _title(w.name, w.T, w.doc_lens, w.H, w.HV, w.K, w.V, w.dtype)
        run.floor_ms = {op: w.floor(op)["ms"] for op in groups}
    except Exception:  # noqa: BLE001  (an unknown workload name: keep the log's own line)
        pass
    for op, arms in groups.items():
        run.medians[op] = {a: statistics.median(v) for a, v in arms.items()}
        run.calls[op] = {a: len(v) for a, v in arms.items()}
    return run


def markdown(runs: List[Run], baseline: Optional[str] = "flashqla") -> str:
    """One table per run: arm x op median ms, and the ratio to the baseline arm."""
    out = []
    for run in runs:
        ops = list(run.medians)
        arms = list(dict.fromkeys(a for op in ops for a in run.medians[op]))
        out.append(f"{run.title} ({run.note})\n")
        hdr = "| arm | " + " | ".join(f"{op} ms" for op in ops) + " |"
        if baseline:
            hdr += " " + " | ".join(f"{op} x {baseline}" for op in ops) + " |"
        out.append(hdr)
        out.append("|" + "---|" * (hdr.count("|") - 1))
        for a in arms:
            ms = [run.medians[op].get(a) for op in ops]
            row = f"| {ARMS.get(a, (a,))[0]} | " + " | ".join(
                "-" if x is None else f"{x:.2f}" for x in ms) + " |"
            if baseline:
                row += " " + " | ".join(
                    "-" if (x is None or baseline not in run.medians[op]) else
                    f"{run.medians[op][baseline] / x:.2f}" for x, op in zip(ms, ops)) + " |"
            out.append(row)
        if run.floor_ms:
            out.append("| floor (FLOPs at 795 TFLOP/s) | " + " | ".join(
                f"{run.floor_ms[op]:.2f}" if op in run.floor_ms else "-" for op in ops) + " |"
                + (" " + " | ".join("" for _ in ops) + " |" if baseline else ""))
        out.append("")
    return "\n".join(out)


def plot(runs: List[Run], out: str) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks.plot needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(run, op) for run in runs for op in run.medians]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (run, op) in zip(axes[0], panels):
        arms = sorted(run.medians[op], key=lambda a: run.medians[op][a])
        ms = [run.medians[op][a] for a in arms]
        colours = [ARMS.get(a, (a, OTHER_COLOUR))[1] for a in arms]
        labels = [ARMS.get(a, (a,))[0] +
                  (CUDA_BWD_NOTE if run.xla_bwd and a.startswith("cuda") and op != "fwd" else "")
                  for a in arms]
        bars = ax.barh(labels, ms, color=colours)
        for b, x in zip(bars, ms):
            ax.text(x, b.get_y() + b.get_height() / 2, f" {x:.1f}", va="center", fontsize=8)
        if op in run.floor_ms:
            ax.axvline(run.floor_ms[op], color="k", ls="--", lw=0.8)
            ax.text(run.floor_ms[op], len(arms) - 0.5, " floor", fontsize=7, va="bottom")
        ax.set_xlim(0, max(ms) * 1.2)
        ax.invert_yaxis()
        ax.set_xlabel("median ms per call (lower is better)")
        ax.set_title(f"{run.workload} {op}", fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
    notes = "; ".join(dict.fromkeys(f"{r.workload}: {r.note}" for r in runs))
    fig.suptitle("Gated DeltaNet op (packed documents, q/k L2 norm), one process, one GPU; "
                 "dashed line: FLOP floor at 795 TFLOP/s\n" + notes, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=130)
    print(f"wrote {out}", file=sys.stderr)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", nargs="*", default=None, help="result JSONs (default: the latest B23 peers run)")
    p.add_argument("--log", nargs="*", default=None, help="progress logs of unfinished runs")
    p.add_argument("--out", default=DEFAULT_OUT, help="PNG path ('' for none)")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables to stdout")
    p.add_argument("--baseline", default="flashqla", help="arm for the ratio columns ('' for none)")
    a = p.parse_args(argv)
    jsons = DEFAULT_JSON if a.json is None else a.json
    logs = DEFAULT_LOG if a.log is None and a.json is None else (a.log or [])
    runs = [load_json(f) for f in jsons] + [load_log(f) for f in logs]
    if a.markdown:
        print(markdown(runs, a.baseline or None))
    if a.out:
        plot(runs, a.out)


if __name__ == "__main__":
    main()
