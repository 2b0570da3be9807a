"""The timing protocol (docs/design.md, performance protocol) and its report.

    python -m benchmarks.run --workload B23 --ops fwd,fwd+bwd --arms cuda,flashqla,fla
    python -m benchmarks.run --workload B23 --tokens 65536 --docs 6 --heads 2,6 --arms cuda,xla

Per op: every arm is set up (compiled), warmed up and checked against the baseline arm's outputs
(relative RMS); then `--groups` groups run. A group runs the arms in palindromic order, A B ... B
A, each block being half of the arm's `--calls` timed calls, so drift inside a group hits every
arm alike. Before every warm-up and timed call the arm's own framework flushes L2 (a 256 MiB
buffer, `--flush-mib`; none on CPU) and waits for it; a timed call is `perf_counter()` around
`call(); sync(result)` with the arm's own sync. Reported per arm and op: the median of the group
medians, their spread (max - min) / median (above 5%: marked `*`), the FLOP rate, the device
time per call (the sum of its GPU activity in the framework's profiler, `--device-calls` calls
after all timing) and wall minus device time, the ratio to the baseline arm, the floor fraction,
the check error and the peak memory of one call.

The table goes to stdout, progress to stderr, everything (every timed call too) to
`<out>/<workload>_<tag or UTC timestamp>.json`, rewritten after each op.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from benchmarks import arms as arms_mod
from benchmarks import workloads

SCHEMA = 2
SPREAD_LIMIT = 0.05  # group-median spread above which a cell is marked
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def default_out_dir() -> str:
    """Where results go unless --out says otherwise: outside the source tree."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "jax-cake-gdn", "bench")


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=_Help)
    p.add_argument("--workload", default="B23", help="named workload, the base of the shape "
                   "options below: " + ", ".join(workloads.names()))
    p.add_argument("--tokens", type=int, default=None,
                   help="custom shape: tokens T (None: the workload's)")
    p.add_argument("--docs", default=None, help="custom shape: document lengths 'a,b,c' or a "
                   "count N that splits T evenly (None: the workload's; with --tokens alone, "
                   "its document count)")
    p.add_argument("--heads", default=None, help="custom shape: 'H,HV' or 'H' (None: the "
                   "workload's)")
    p.add_argument("--head-dim", default=None, help="custom shape: 'K,V' or 'D' (None: the "
                   "workload's)")
    p.add_argument("--ops", default="fwd,fwd+bwd,ckpt", help="comma list of fwd, fwd+bwd, ckpt")
    p.add_argument("--arms", default="xla,cuda",
                   help="comma list of arm specs name[:opt...]: xla, cuda, base (options light, "
                        "full, det, P<n>, tiles0/1/2), "
                        "kcp:W[:layout][:exchange][:light|full][:xla][:P<n>][:xonly], flashqla, "
                        "fla")
    p.add_argument("--baseline", default=None,
                   help="arm spec the ratios are against (None: the first arm that ran)")
    p.add_argument("--groups", type=int, default=5, help="groups of palindromic blocks")
    p.add_argument("--calls", type=int, default=12,
                   help="timed calls per arm per group (split over A..Z Z..A)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per arm after setup")
    p.add_argument("--flush-mib", type=int, default=None,
                   help="L2 flush buffer before each call, MiB (None: 256 on a GPU, 0 on CPU)")
    p.add_argument("--device-calls", type=int, default=3,
                   help="profiled calls per arm and op for the device time (0: no profile)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--out", default=default_out_dir(),
                   help="folder for the JSON (empty string: no file)")
    p.add_argument("--tag", default=None, help="file name tag (None: the UTC timestamp)")
    p.add_argument("--no-check", action="store_true", help="skip the cross-arm output check")
    p.add_argument("--strict", action="store_true",
                   help="fail instead of skipping an arm that cannot run")
    a = p.parse_args(argv)
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    for o in a.ops:
        if o not in workloads.OPS:
            p.error(f"unknown op {o!r}; known: {', '.join(workloads.OPS)}")
    a.arms = [s.strip() for s in a.arms.split(",") if s.strip()]
    if a.groups < 1 or a.calls < 1 or a.warmup < 0 or a.device_calls < 0:
        p.error("--groups and --calls must be >= 1, --warmup and --device-calls >= 0")
    try:
        a.wl = workloads.get(a.workload)
        if any(x is not None for x in (a.tokens, a.docs, a.heads, a.head_dim)):
            a.wl = workloads.custom(a.wl, tokens=a.tokens, docs=a.docs, heads=a.heads,
                                    head_dim=a.head_dim)
    except ValueError as e:
        p.error(str(e))
    return a


def _git_commit():
    """HEAD of the repository this file is in ("+dirty" when it has changes), else None.

    None too when the nearest .git belongs to a folder above this checkout (a copy of the tree
    inside another repository would otherwise report that repository's HEAD)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,
                                    timeout=10).stdout.strip()
    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel") or "/") != os.path.realpath(root):
            return None
        head = git("rev-parse", "HEAD")
        return (head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
                ) if head else None
    except Exception:  # noqa: BLE001
        return None


def _library_info():
    try:
        import jax_cake_gdn
        from jax_cake_gdn import primitives

        return {"version": getattr(jax_cake_gdn, "__version__", None),
                "cuda_kernels": list(getattr(primitives, "CUDA_KERNELS", []) or [])}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def rel_rms(x, ref, block: int = 1 << 22):
    """||x - ref|| / ||ref|| in float64, a block of elements at a time (no full-size f64 copies:
    the check of a 262144-token workload's gradients)."""
    import numpy as np

    x, ref = np.asarray(x).reshape(-1), np.asarray(ref).reshape(-1)
    if x.size != ref.size:
        raise ValueError(f"rel_rms: {x.size} elements against {ref.size}")
    num = den = 0.0
    for i in range(0, ref.size, block):
        r = ref[i:i + block].astype(np.float64)
        d = x[i:i + block].astype(np.float64) - r
        num += float(np.dot(d, d))
        den += float(np.dot(r, r))
    num, den = float(np.sqrt(num)), float(np.sqrt(den))
    return num / den if den > 0 else num


def timed_call(arm, call, flush_mib):
    """One timed call as the protocol makes it: the arm's flush, then `perf_counter()` around
    `call(); sync(result)`. Returns (ms, dispatch ms: until `call()` returned)."""
    arm.flush(flush_mib)
    t0 = time.perf_counter()
    res = call()
    t1 = time.perf_counter()
    arm.sync(res)
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3, (t1 - t0) * 1e3


def time_op(op, arm_list, fns, args, flush_mib):
    """Palindromic groups over the arms that set up. Returns ({arm name: [[ms per call] per
    group]}, the same for the dispatch part of each call)."""
    times = {a.name: [] for a in arm_list}
    dispatch = {a.name: [] for a in arm_list}
    first, second = (args.calls + 1) // 2, args.calls // 2
    for gi in range(args.groups):
        for a in arm_list:
            times[a.name].append([])
            dispatch[a.name].append([])
        order = [(a, first) for a in arm_list] + [(a, second) for a in reversed(arm_list)]
        for a, n in order:
            call, t_block = fns[a.name], time.perf_counter()
            for _ in range(n):
                ms, dispatch_ms = timed_call(a, call, flush_mib)
                times[a.name][gi].append(ms)
                dispatch[a.name][gi].append(dispatch_ms)
            if n and time.perf_counter() - t_block > 1.0:  # a long block says where the run is
                log(f"  {op}: group {gi + 1}/{args.groups}: {a.name} {n} calls done")
        meds = ", ".join(f"{a.name} {statistics.median(times[a.name][gi]):.3f} "
                         f"({statistics.median(dispatch[a.name][gi]):.3f})" for a in arm_list)
        log(f"  {op}: group {gi + 1}/{args.groups} medians ms (dispatch): {meds}")
    return times, dispatch


def summarize(groups_ms):
    """The row's statistics of [[ms per call] per group]: median_ms is the median of the group
    medians; spread = (max - min) / median of the group medians, flagged above SPREAD_LIMIT;
    drift = |last - first| / median of the group medians."""
    flat = [t for g in groups_ms for t in g]
    gm = [statistics.median(g) for g in groups_ms]
    mgm = statistics.median(gm)
    spread = (max(gm) - min(gm)) / mgm if mgm > 0 else 0.0
    return {"median_ms": mgm, "median_calls_ms": statistics.median(flat), "min_ms": min(flat),
            "mean_ms": statistics.fmean(flat), "group_medians_ms": gm, "spread": spread,
            "spread_flag": spread > SPREAD_LIMIT,
            "drift": abs(gm[-1] - gm[0]) / mgm if mgm > 0 else 0.0, "n_calls": len(flat)}


def _fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


def print_table(wl, rows, baseline, file=None):
    file = file or sys.stdout
    print(f"\nworkload {wl.name}: T={wl.T} docs={list(wl.doc_lens)} heads=({wl.H},{wl.HV}) "
          f"K={wl.K} V={wl.V} {wl.dtype} l2norm={wl.qk_l2norm} layer={wl.layer}", file=file)
    hdr = (f"{'arm':<18} {'op':<8} {'median ms':>10} {'spread %':>9} {'TFLOP/s':>8} "
           f"{'device ms':>10} {'wall-dev':>9} {'x ' + (baseline or '-'):>12} "
           f"{'floor frac':>10} {'max err':>9} {'peak GiB':>9}")
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rows:
        spread = f"{100 * r['spread']:.1f}" + ("*" if r["spread_flag"] else " ")
        peak = r["peak_bytes"] / 2**30 if r.get("peak_bytes") else None
        print(f"{r['arm']:<18} {r['op']:<8} {r['median_ms']:>10.3f} {spread:>9} "
              f"{r['tflops']:>8.3g} {_fmt(r.get('device_ms'), '.3f'):>10} "
              f"{_fmt(r.get('wall_minus_device_ms'), '.3f'):>9} "
              f"{_fmt(r.get('speedup_vs_baseline'), '.2f'):>12} {r['floor_fraction']:>10.3g} "
              f"{_fmt(r.get('check', {}).get('max_rel_rms'), '.1e'):>9} {_fmt(peak, '.2f'):>9}",
              file=file)
    floors = ", ".join(f"{op} {r['floor_ms']:.3g} ms" for op, r in
                       {r["op"]: r for r in rows}.items())
    print(f"median ms: median of the group medians; spread: (max - min) / median of the group "
          f"medians, * above {100 * SPREAD_LIMIT:.0f}%\n"
          "device ms: GPU activity per call in the arm's profiler; wall-dev: median - device ms\n"
          f"x {baseline}: baseline median / arm median (> 1: faster); floor fraction: floor / "
          f"median, floor = max(FLOPs / {workloads.PEAK_FLOPS / 1e12:.0f} TFLOP/s, bytes / "
          f"{workloads.PEAK_BYTES / 1e12:.2f} TB/s): {floors}\n"
          "max err: relative RMS against the baseline arm's outputs; peak GiB: device memory of "
          "one call", file=file)


def _setup(a, wl, op, inputs, args, flush_mib, skipped):
    """The arm's call for `op`, warmed up; None (recorded in `skipped`) if it cannot run."""
    log(f"{op}: setting up {a.name} (compile)")
    try:
        call = a.setup(wl, op, inputs)
    except Exception as e:  # noqa: BLE001
        if args.strict:
            raise
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        print(f"SKIP arm {a.name} op {op}: {reason}", file=sys.stderr, flush=True)
        skipped.append({"arm": a.name, "op": op, "reason": reason})
        return None
    for _ in range(args.warmup):
        a.flush(flush_mib)
        a.sync(call())
    return call


def _check(op, base, ready, fns):
    """{arm name: errors against the baseline arm's outputs} for the arms that give outputs."""
    checks = {}
    if base is None or base.to_numpy is None:
        return checks
    ref = base.to_numpy(fns[base.name]())
    for a in ready:
        if a is base or a.to_numpy is None:
            continue
        errs = [rel_rms(x, r) for x, r in zip(a.to_numpy(fns[a.name]()), ref)]
        checks[a.name] = {"against": base.name, "rel_rms": errs, "max_rel_rms": max(errs)}
        log(f"{op}: {a.name} vs {base.name} max rel RMS {max(errs):.2e}")
    return checks


def _device_times(arm_list, calls, rows, flush_mib, n):
    """Each row's device time from `n` profiled calls. JAX arms go first: a torch profile can
    keep CUPTI from the JAX profiler for the rest of the process."""
    for a in sorted(arm_list, key=lambda a: a.framework.name != "jax"):
        for (name, op), call in calls.items():
            if name != a.name:
                continue
            log(f"{op}: device time of {a.name} ({n} profiled calls)")
            try:
                d = a.device_times(call, flush_mib, n)
            except Exception as e:  # noqa: BLE001 - a failed profile leaves the timings be
                d = {"device_ms": None, "calls_ms": [None] * n, "launches": [0] * n,
                     "reason": f"profile failed: {type(e).__name__}: {e}"}
            row = rows[name, op]
            row.update(device_ms=d["device_ms"], device_calls_ms=d["calls_ms"],
                       device_launches=d["launches"],
                       wall_minus_device_ms=(row["median_ms"] - d["device_ms"]
                                             if d["device_ms"] is not None else None))
            if d["reason"]:
                row["device_note"] = d["reason"]
                log(f"{op}: {a.name}: {d['reason']}")


def main(argv=None):
    args = parse_args(argv)
    wl = args.wl
    arm_list = [arms_mod.make_arm(s) for s in args.arms]
    if len({a.name for a in arm_list}) != len(arm_list):
        raise SystemExit("duplicate arm specs")
    if any(a.framework.name == "torch" for a in arm_list):
        # torch shares the GPU in this process: JAX must not grab 75% of it up front.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import jaxlib
    import numpy as np

    dev = jax.devices()[0]
    flush_mib = args.flush_mib
    if flush_mib is None:
        flush_mib = 0 if dev.platform == "cpu" else 256
    log(f"device {dev.platform}:{dev.device_kind}, jax {jax.__version__}, workload {wl.name} "
        f"(T={wl.T}), arms {[a.name for a in arm_list]}, ops {args.ops}, flush {flush_mib} MiB")
    if args.groups * args.calls < 20:
        log(f"note: {args.groups * args.calls} timed calls per arm (< 20, the protocol minimum)")

    log("generating inputs")
    inputs = wl.make_inputs(args.seed)
    path = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = args.tag or _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = os.path.join(args.out, f"{wl.name}_{tag}.json")
    result = {
        "schema": SCHEMA,
        "complete": False,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv if argv is None else list(argv),
        "workload": wl.describe(),
        "device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count()},
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "library": _library_info(),
        "git_commit": _git_commit(),
        "config": {"groups": args.groups, "calls": args.calls, "warmup": args.warmup,
                   "flush_mib": flush_mib, "device_calls": args.device_calls, "seed": args.seed,
                   "baseline": args.baseline, "spread_limit": SPREAD_LIMIT,
                   "order": "palindromic per group: A..Z (ceil(calls/2) each) then Z..A (floor)"},
        "floor": {op: wl.floor(op) for op in args.ops},
        "peaks": {"flops": workloads.PEAK_FLOPS, "bytes": workloads.PEAK_BYTES},
        "results": [],
        "skipped": [],
    }

    def write():
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)

    rows, skipped = {}, result["skipped"]
    calls, timed_arms = {}, {}  # (arm, op) -> call, kept for the device-time pass
    for op in args.ops:
        ready, fns = [], {}
        for a in arm_list:
            call = _setup(a, wl, op, inputs, args, flush_mib, skipped)
            if call is not None:
                ready.append(a)
                fns[a.name] = call
        if not ready:
            continue
        base = ready[0] if not args.baseline else next(
            (a for a in ready if a.name == args.baseline), None)
        checks = {} if args.no_check else _check(op, base, ready, fns)

        log(f"{op}: timing {len(ready)} arm(s), {args.groups} groups x {args.calls} calls")
        times, dispatch = time_op(op, ready, fns, args, flush_mib)
        fl = wl.floor(op)
        base_med = summarize(times[base.name])["median_ms"] if base else None
        for a in ready:
            s = summarize(times[a.name])
            rows[a.name, op] = {
                "arm": a.name, "op": op, "framework": a.framework.name, "options": a.options,
                **s, "times_ms": times[a.name],
                "dispatch_median_ms": statistics.median([t for g in dispatch[a.name] for t in g]),
                "dispatch_group_medians_ms": [statistics.median(g) for g in dispatch[a.name]],
                "tflops": wl.tflops(op, s["median_ms"]),
                "device_ms": None, "wall_minus_device_ms": None,
                "baseline": base.name if base else None,
                "speedup_vs_baseline": (base_med / s["median_ms"]) if base_med else None,
                "floor_ms": fl["ms"], "floor_fraction": fl["ms"] / s["median_ms"],
                "peak_bytes": getattr(fns[a.name], "peak_bytes", None),
                **({"check": checks[a.name]} if a.name in checks else {})}
            calls[a.name, op] = fns[a.name]
            timed_arms[a.name] = a
        result["results"] = list(rows.values())
        write()
        del fns, ready

    if args.device_calls > 0 and calls:
        _device_times(list(timed_arms.values()), calls, rows, flush_mib, args.device_calls)
    calls.clear()

    rows = list(rows.values())
    baseline_name = args.baseline or (rows[0]["baseline"] if rows else None)
    print_table(wl, rows, baseline_name)
    for s in skipped:
        print(f"skipped: {s['arm']} {s['op']}: {s['reason']}")
    result["config"]["baseline"] = baseline_name
    result["results"], result["complete"] = rows, True
    write()
    if path:
        log(f"wrote {path}")
    result["path"] = path
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["results"] else 1)
