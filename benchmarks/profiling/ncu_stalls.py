"""Warp-stall samples of one kernel per SASS instruction, from Nsight Compute, summed by region.

On the GPU machine, profile one launch with source counters and export the SASS view:

    ncu --set full --import-source yes --kernel-name regex:prep_kernel --launch-count 1 \\
        -o /tmp/p python -m benchmarks.profiling.device_times --child --workload B23 --ops fwd \\
        --modes light --backend cuda
    ncu --import /tmp/p.ncu-rep --page source --csv --print-source sass > prep_sass.csv

then, anywhere:

    python -m benchmarks.profiling.ncu_stalls prep_sass.csv [--top 25] [--split BAR.SYNC,EXIT]

prints the samples by stall reason, the instructions with the most samples (and each one's
leading reason), and with `--split` the samples between consecutive instructions that contain
one of the given substrings (a region ends at and includes its marker): split at a kernel's
barriers, waits and exits, the regions are its phases. ncu charges a warp's wait at a barrier to
the instruction after the barrier (stall reason "barrier").
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from typing import Dict, List, Sequence

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass
class Instr:
    index: int  # position in the SASS listing
    source: str
    samples: int
    reasons: Dict[str, int]  # stall_<reason> -> samples (issued and not issued together)


def read_sass_csv(path: str) -> List[Instr]:
    """The instructions of the first kernel in an `ncu --page source --csv --print-source sass`
    export (its first line names the kernel, the second is the header)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows[:5]) if "Source" in r and SAMPLES in r), None)
    if header_at is None:
        raise ValueError(f"{path}: no header with 'Source' and '{SAMPLES}' in its first lines; "
                         "export with --page source --csv --print-source sass")
    hdr = rows[header_at]
    i_src, i_smp = hdr.index("Source"), hdr.index(SAMPLES)
    reason_cols = [(j, h) for j, h in enumerate(hdr)
                   if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[header_at + 1:]:
        if len(r) <= i_smp or not r[i_smp].strip().isdigit():
            if r and r[0] == "Kernel Name":
                break  # the next kernel's block
            continue
        reasons = {h: int(r[j]) for j, h in reason_cols if j < len(r) and r[j].strip().isdigit()}
        out.append(Instr(len(out), r[i_src].strip(), int(r[i_smp]), reasons))
    if not out:
        raise ValueError(f"{path}: no instruction rows")
    return out


def by_reason(instrs: Sequence[Instr]) -> Dict[str, int]:
    tot: Dict[str, int] = {}
    for ins in instrs:
        for k, v in ins.reasons.items():
            tot[k] = tot.get(k, 0) + v
    return dict(sorted(tot.items(), key=lambda kv: -kv[1]))


def regions(instrs: Sequence[Instr], markers: Sequence[str]) -> List[tuple]:
    """[(first index, last index, marker source, samples)]: the listing cut after every
    instruction whose source contains one of `markers`; the tail after the last one too."""
    out, start, acc = [], 0, 0
    for ins in instrs:
        acc += ins.samples
        if any(m in ins.source for m in markers):
            out.append((start, ins.index, ins.source, acc))
            start, acc = ins.index + 1, 0
    if start < len(instrs):
        out.append((start, len(instrs) - 1, "(end)", acc))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass export")
    p.add_argument("--top", type=int, default=25, help="instructions to list")
    p.add_argument("--split", default="", help="comma list of SASS substrings that end a region")
    args = p.parse_args(argv)
    instrs = read_sass_csv(args.csv)
    total = sum(i.samples for i in instrs)
    if total == 0:
        print(f"{args.csv}: no stall samples", file=sys.stderr)
        return 1
    print(f"{len(instrs)} instructions, {total} samples")
    print("by reason: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%"
                                   for k, v in list(by_reason(instrs).items())[:8]))
    print(f"\ntop {args.top} instructions:")
    for ins in sorted(instrs, key=lambda i: -i.samples)[:args.top]:
        lead = max(ins.reasons.items(), key=lambda kv: kv[1], default=("-", 0))
        print(f"  {ins.samples:7d} {100 * ins.samples / total:5.1f}%  #{ins.index:<5d} "
              f"{ins.source[:56]:56s} {lead[0][6:]} {lead[1]}")
    if args.split:
        print("\nregions (each ends at its marker):")
        for a, b, src, s in regions(instrs, [m for m in args.split.split(",") if m]):
            print(f"  #{a:5d}-#{b:<5d} {s:7d} {100 * s / total:5.1f}%  {src[:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
