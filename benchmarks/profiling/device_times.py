"""Device time of every kernel inside one gdn call, from Nsight Compute.

    python -m benchmarks.profiling.device_times --workload B23 [--ops fwd,fwd+bwd]
        [--modes light,full] [--backend cuda] [--out DIR]

For each (op, save mode) a child process runs the jitted op of `benchmarks.arms.build_jax_op` once
under `ncu --metrics gpu__time_duration.sum` (inputs are rounded on the host and copied, and
XLA's autotuner is off, so the op's own launches are the only kernels), and this process prints
each launch in order with its device time, the kernel totals and their sum. Unlike
`benchmarks.profiling.kernels` (wall clock per call, one dispatch each) this shows XLA's own
fusions between the primitives and sums to the op's GPU time without launch gaps; unlike a timed
run it serialises the launches (ncu), so use it to see where the time goes, never as a result to
compare with peers. Needs ncu (PATH, CUDA_HOME/bin or /opt/nvidia/nsight-compute/*/) and a GPU;
`--out` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

_CHILD = "--child"


def find_ncu() -> Optional[str]:
    """The ncu executable, or None."""
    cands = [shutil.which("ncu")]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        cands.append(os.path.join(home, "bin", "ncu"))
    cands += sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    cands.append("/usr/local/cuda/bin/ncu")
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def short_name(kernel: str) -> str:
    """`void ns::name_kernel<T, 128>(...)` -> `name_kernel<T, 128>`; XLA fusions stay as named."""
    name = re.sub(r"\((?:int|bool|long|unsigned int)\)", "", kernel)  # template value casts
    name = name.split("(")[0].strip()
    name = re.sub(r"^void\s+", "", name).replace("<unnamed>::", "")
    name = re.sub(r"\b[A-Za-z_]\w*::", "", name)
    return name.replace("__nv_bfloat16", "bf16")


def parse_ncu_csv(text: str) -> List[Tuple[str, float]]:
    """[(kernel name, device ms)] in launch order from `ncu --csv --metrics
    gpu__time_duration.sum` output (other lines, such as the profiled program's, are skipped)."""
    rows, header = [], None
    for rec in csv.reader(io.StringIO(text)):
        if not rec:
            continue
        if rec[0] == "ID" and "Kernel Name" in rec:
            header = rec
            continue
        if header is None or len(rec) != len(header) or not rec[0].isdigit():
            continue
        d = dict(zip(header, rec))
        if d.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(d["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0,
                 "msecond": 1.0}.get(d.get("Metric Unit", "ns"))
        if scale is None:
            raise ValueError(f"unknown ncu time unit {d.get('Metric Unit')!r}")
        rows.append((d["Kernel Name"], value * scale))
    return rows


def summarize(rows: List[Tuple[str, float]]) -> Dict[str, dict]:
    """{short name: {"calls": n, "ms": total}}, in first-launch order."""
    out: Dict[str, dict] = {}
    for name, ms in rows:
        e = out.setdefault(short_name(name), {"calls": 0, "ms": 0.0})
        e["calls"] += 1
        e["ms"] += ms
    return out


def _child(args) -> None:
    import jax
    import ml_dtypes
    import numpy as np

    from .. import workloads
    from ..arms import build_jax_op

    wl = workloads.get(args.workload)
    inp = wl.make_inputs(seed=0)
    act = ml_dtypes.bfloat16 if wl.dtype == "bf16" else np.float32
    dev = {}
    for n, a in inp.items():  # rounded on the host: no conversion kernel on the device
        dt = np.int32 if n == "cu_seqlens" else np.float32 if n in ("g", "beta") else act
        dev[n] = jax.device_put(np.asarray(a).astype(dt))
    fn, names = build_jax_op(wl, args.ops, backend=args.backend, save_mode=args.modes)
    jax.block_until_ready(fn(tuple(dev[n] for n in names), dev["do"], dev["cu_seqlens"]))


def _run_one(ncu: str, workload: str, op: str, mode: str, backend: str) -> List[Tuple[str, float]]:
    cmd = [ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
           sys.executable, "-m", "benchmarks.profiling.device_times", _CHILD,
           "--workload", workload, "--ops", op, "--modes", mode, "--backend", backend]
    # no autotuning: its timing kernels (DelayKernel, RedzoneAllocator, ...) would join the list
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_FLAGS=flags)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"ncu run failed ({res.returncode}):\n{res.stdout[-2000:]}\n"
                           f"{res.stderr[-2000:]}")
    rows = parse_ncu_csv(res.stdout)
    if not rows:
        raise RuntimeError(f"ncu reported no kernels:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return rows


def main(argv=None) -> int:
    from .. import workloads

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(_CHILD, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="B23", help="one of: " + ", ".join(workloads.names()))
    ap.add_argument("--ops", default="fwd,fwd+bwd", help="comma list of fwd, fwd+bwd, ckpt")
    ap.add_argument("--modes", default="light,full", help="comma list of save modes")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "xla"))
    ap.add_argument("--out", default=None, help="directory for <workload>_device_times.json")
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    ncu = find_ncu()
    if ncu is None:
        print("[device_times] ncu not found (PATH, CUDA_HOME/bin, /opt/nvidia/nsight-compute)",
              file=sys.stderr)
        return 2
    workloads.get(args.workload)  # a clear error for an unknown name before any ncu run
    result = {"workload": args.workload, "backend": args.backend, "ncu": ncu, "runs": {}}
    for op in args.ops.split(","):
        for mode in args.modes.split(","):
            t0 = time.perf_counter()
            print(f"[device_times] {args.workload} {op} {mode}: running under ncu ...",
                  file=sys.stderr, flush=True)
            rows = _run_one(ncu, args.workload, op, mode, args.backend)
            total = sum(ms for _, ms in rows)
            print(f"\n== {args.workload} {op} {mode}: {len(rows)} launches, {total:.3f} ms device "
                  f"time ({time.perf_counter() - t0:.0f} s under ncu)")
            for i, (name, ms) in enumerate(rows):
                print(f"  {i:3d} {ms:8.3f} ms  {short_name(name)}")
            print("  by kernel:")
            for name, e in summarize(rows).items():
                print(f"    {e['ms']:8.3f} ms  x{e['calls']:<2d} {name}")
            result["runs"][f"{op} {mode}"] = {"launches": [[short_name(n), ms] for n, ms in rows],
                                              "total_ms": total}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{args.workload}_device_times.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[device_times] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
