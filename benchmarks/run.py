"""The timing protocol of DESIGN.md section 5.

    python -m benchmarks.run --workload B23 --ops fwd,fwd+bwd,ckpt --arms xla,cuda \
        --groups 5 --calls 12 --warmup 3 --out benchmarks/results/

Per op: every arm is set up (compiled) and warmed up, then `--groups` groups run. A group runs
the arms in palindromic order, A B ... B A, each block being half of the arm's `--calls` timed
calls, so drift inside a group hits every arm alike. Before every timed call (and warm-up call)
an L2 flush writes a 256 MiB device buffer (`--flush-mib`; 0 on CPU by default, where it is
skipped). A timed call is `perf_counter()` around `call(); sync(result)`; the time until `call()`
returns (dispatch: every launch enqueued) is kept too. Reported per arm: the
median over all timed calls, the drift |last group median - first group median| / median of the
group medians, the speedup of the baseline arm's median over this arm's, and the floor fraction
(floor / median; floor = max(FLOPs / 795 TFLOP/s, bytes / 4.26 TB/s)). Arms are checked against
the baseline arm's outputs (relative RMS error) unless `--no-check`.

The table goes to stdout, progress to stderr, everything (with every per-call time) to
`<out>/<workload>_<tag or UTC timestamp>.json`.
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

SCHEMA = 1
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="B23", help="one of: " + ", ".join(workloads.names()))
    p.add_argument("--ops", default="fwd,fwd+bwd,ckpt", help="comma list of fwd, fwd+bwd, ckpt")
    p.add_argument("--arms", default="xla,cuda",
                   help="comma list of arm specs name[:opt...], e.g. xla,cuda,cuda:full "
                        f"(arms: {', '.join(sorted(arms_mod.FACTORIES))}; options light, full, det)")
    p.add_argument("--baseline", default=None, help="arm spec the ratios are against (default: first arm that ran)")
    p.add_argument("--groups", type=int, default=5)
    p.add_argument("--calls", type=int, default=12, help="timed calls per arm per group (split over A..B B..A)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per arm after setup")
    p.add_argument("--flush-mib", type=int, default=None, help="L2 flush buffer size (default 256; 0 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/", help="folder for the JSON (empty string: none)")
    p.add_argument("--tag", default=None, help="file name tag instead of the timestamp")
    p.add_argument("--no-check", action="store_true", help="skip the cross-arm output check")
    p.add_argument("--strict", action="store_true", help="fail instead of skipping an arm that cannot run")
    a = p.parse_args(argv)
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    for o in a.ops:
        if o not in workloads.OPS:
            p.error(f"unknown op {o!r}; known: {', '.join(workloads.OPS)}")
    a.arms = [s.strip() for s in a.arms.split(",") if s.strip()]
    if a.groups < 1 or a.calls < 1 or a.warmup < 0:
        p.error("--groups and --calls must be >= 1, --warmup >= 0")
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


def make_flush(mib: int):
    """A function that writes (and reads) a `mib` MiB device buffer and waits for it."""
    if mib <= 0:
        return lambda: None
    import jax
    import jax.numpy as jnp

    state = {"buf": jnp.zeros((mib * 2**20 // 4,), jnp.float32)}
    bump = jax.jit(lambda b: b + 1.0, donate_argnums=0)

    def flush():
        state["buf"] = bump(state["buf"])
        state["buf"].block_until_ready()

    flush()
    return flush


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


def time_op(op, arm_list, calls_fns, args, flush):
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
            call = calls_fns[a.name]
            for _ in range(n):
                flush()
                t0 = time.perf_counter()
                res = call()
                t1 = time.perf_counter()
                a.sync(res)
                dt = time.perf_counter() - t0
                del res
                times[a.name][gi].append(dt * 1e3)
                dispatch[a.name][gi].append((t1 - t0) * 1e3)
        meds = ", ".join(f"{a.name} {statistics.median(times[a.name][gi]):.3f} "
                         f"({statistics.median(dispatch[a.name][gi]):.3f})" for a in arm_list)
        log(f"  {op}: group {gi + 1}/{args.groups} medians ms (dispatch): {meds}")
    return times, dispatch


def summarize(groups_ms):
    flat = [t for g in groups_ms for t in g]
    gm = [statistics.median(g) for g in groups_ms]
    med = statistics.median(flat)
    mgm = statistics.median(gm)
    drift = abs(gm[-1] - gm[0]) / mgm if mgm > 0 else 0.0
    return {"median_ms": med, "min_ms": min(flat), "mean_ms": statistics.fmean(flat),
            "group_medians_ms": gm, "drift": drift, "n_calls": len(flat)}


def print_table(wl, rows, baseline, file=sys.stdout):
    print(f"\nworkload {wl.name}: T={wl.T} docs={list(wl.doc_lens)} heads=({wl.H},{wl.HV}) "
          f"K={wl.K} V={wl.V} {wl.dtype} l2norm={wl.qk_l2norm} layer={wl.layer}", file=file)
    hdr = f"{'arm':<16} {'op':<8} {'median ms':>10} {'drift %':>8} {'x ' + (baseline or '-'):>12} " \
          f"{'floor ms':>9} {'floor frac':>10} {'max err':>9} {'peak GiB':>9}"
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rows:
        ratio = f"{r['speedup_vs_baseline']:.2f}" if r.get("speedup_vs_baseline") else "-"
        err = r.get("check", {}).get("max_rel_rms")
        err = f"{err:.1e}" if err is not None else "-"
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "-"
        print(f"{r['arm']:<16} {r['op']:<8} {r['median_ms']:>10.3f} {100 * r['drift']:>8.1f} "
              f"{ratio:>12} {r['floor_ms']:>9.3g} {r['floor_fraction']:>10.3g} {err:>9} {peak:>9}", file=file)
    print(f"(x {baseline}: baseline median / arm median, > 1 is faster; floor = max(FLOPs / "
          f"{workloads.PEAK_FLOPS / 1e12:.0f} TFLOP/s, bytes / {workloads.PEAK_BYTES / 1e12:.2f} "
          "TB/s); max err: relative RMS vs the baseline arm's outputs; peak GiB: device memory of "
          "one call, see benchmarks/arms.py)", file=file)


def main(argv=None):
    args = parse_args(argv)
    wl = workloads.get(args.workload)
    arm_list = [arms_mod.make_arm(s) for s in args.arms]
    if len({a.name for a in arm_list}) != len(arm_list):
        raise SystemExit("duplicate arm specs")
    if any(a.framework == "torch" for a in arm_list):
        # torch shares the GPU in this process: JAX must not grab 75% of it up front.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import jaxlib
    import numpy as np

    dev = jax.devices()[0]
    flush_mib = args.flush_mib if args.flush_mib is not None else (0 if dev.platform == "cpu" else 256)
    log(f"device {dev.platform}:{dev.device_kind}, jax {jax.__version__}, workload {wl.name} "
        f"(T={wl.T}), arms {[a.name for a in arm_list]}, ops {args.ops}, "
        f"flush {flush_mib} MiB" + (" (skipped on CPU)" if flush_mib == 0 and dev.platform == "cpu" else ""))
    if args.groups * args.calls < 20:
        log(f"note: {args.groups * args.calls} timed calls per arm (< 20, the protocol minimum)")

    log("generating inputs")
    inputs = wl.make_inputs(args.seed)
    flush = make_flush(flush_mib)

    rows, skipped = [], []
    for op in args.ops:
        ready, fns, outs = [], {}, {}
        for a in arm_list:
            log(f"{op}: setting up {a.name} (compile)")
            try:
                fns[a.name] = a.setup(wl, op, inputs)
            except Exception as e:  # noqa: BLE001
                if args.strict:
                    raise
                reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                print(f"SKIP arm {a.name} op {op}: {reason}", file=sys.stderr, flush=True)
                skipped.append({"arm": a.name, "op": op, "reason": reason})
                continue
            for _ in range(args.warmup):
                flush()
                a.sync(fns[a.name]())
            ready.append(a)
        if not ready:
            continue

        base = next((a for a in ready if a.name == args.baseline), None) if args.baseline else ready[0]
        checks = {}
        if not args.no_check and base is not None and base.to_numpy is not None:
            ref = base.to_numpy(fns[base.name]())
            for a in ready:
                if a is base or a.to_numpy is None:
                    continue
                got = a.to_numpy(fns[a.name]())
                errs = [rel_rms(x, r) for x, r in zip(got, ref)]
                checks[a.name] = {"against": base.name, "rel_rms": errs, "max_rel_rms": max(errs)}
                log(f"{op}: {a.name} vs {base.name} max rel RMS {max(errs):.2e}")
            del ref

        log(f"{op}: timing {len(ready)} arm(s), {args.groups} groups x {args.calls} calls")
        times, dispatch = time_op(op, ready, fns, args, flush)
        fl = wl.floor(op)
        base_med = statistics.median([t for g in times[base.name] for t in g]) if base else None
        for a in ready:
            s = summarize(times[a.name])
            rows.append({"arm": a.name, "op": op, "framework": a.framework, "options": a.options,
                         **s, "times_ms": times[a.name],
                         "dispatch_median_ms": statistics.median(
                             [t for g in dispatch[a.name] for t in g]),
                         "dispatch_group_medians_ms": [statistics.median(g)
                                                       for g in dispatch[a.name]],
                         "baseline": base.name if base else None,
                         "speedup_vs_baseline": (base_med / s["median_ms"]) if base_med else None,
                         "floor_ms": fl["ms"], "floor_fraction": fl["ms"] / s["median_ms"],
                         "peak_bytes": getattr(fns[a.name], "peak_bytes", None),
                         **({"check": checks[a.name]} if a.name in checks else {})})
        del fns, ready

    baseline_name = args.baseline or (rows[0]["baseline"] if rows else None)
    print_table(wl, rows, baseline_name)
    for s in skipped:
        print(f"skipped: {s['arm']} {s['op']}: {s['reason']}")

    result = {
        "schema": SCHEMA,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv if argv is None else list(argv),
        "workload": wl.describe(),
        "device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count()},
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "library": _library_info(),
        "git_commit": _git_commit(),
        "config": {"groups": args.groups, "calls": args.calls, "warmup": args.warmup,
                   "flush_mib": flush_mib, "seed": args.seed, "baseline": baseline_name,
                   "order": "palindromic per group: A..Z (ceil(calls/2) each) then Z..A (floor)"},
        "floor": {op: wl.floor(op) for op in args.ops},
        "peaks": {"flops": workloads.PEAK_FLOPS, "bytes": workloads.PEAK_BYTES},
        "results": rows,
        "skipped": skipped,
    }
    path = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = args.tag or _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = os.path.join(args.out, f"{wl.name}_{tag}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {path}")
    result["path"] = path
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["results"] else 1)
