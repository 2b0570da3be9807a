"""Host vs device side of one timed call: how long the jitted call takes to return to Python
(dispatch: every launch enqueued) against the call with its sync, as `benchmarks.run` times it.

    python -m benchmarks.profiling.host_time --workload B23 --op fwd --arms cuda --calls 30 \\
        [--trace DIR]

Per arm: `--calls` calls after an L2 flush by the arm's framework (as benchmarks.run), then
`--calls` back to back with no flush. Prints the medians and minima; never asserts on them.
`--trace DIR` also records three flushed calls with `jax.profiler` (JAX arms) and prints the
device timeline of the last one: every kernel with its duration and the idle time before it (the
launch gaps that a sum of kernel times does not show), then that call's host events.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import arms, traces, workloads
from benchmarks.run import timed_call


def timeline(arm, call, trace_dir: str, flush_mib: int) -> None:
    """Trace three flushed calls (JAX arms); print the last call's device events and launch gaps
    and its host events."""
    import jax

    with jax.profiler.trace(trace_dir):
        for i in range(3):
            arm.flush(flush_mib)
            with jax.profiler.TraceAnnotation(traces.call_label(i)):
                arm.sync(call())
    ev, host = traces.jax_events(traces.load(trace_dir))
    r = traces.call_ranges(host)[2]
    last = traces.in_range(ev, r)
    if not last:
        print("  no device events inside the last call's range", flush=True)
        return
    t0, busy, prev_end = last[0][0], 0.0, last[0][0]
    print(f"  device timeline of one call ({len(last)} events; us from its first kernel):")
    for ts, dur, name in last:
        print(f"    {ts - t0:9.1f} +{dur:8.1f} (idle {max(ts - prev_end, 0.0):6.1f})  {name[:90]}")
        busy += dur
        prev_end = max(prev_end, ts + dur)
    span = prev_end - t0
    print(f"  span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f}"
          f" ms between them", flush=True)
    rows = [e for e in host if r[0] <= e[0] <= r[1] and e[1] >= 5.0]
    print(f"  host events of that call ({len(rows)} of >= 5 us; us from its first kernel):")
    for ts, dur, name in rows[:80]:
        print(f"    {ts - t0:9.1f} +{dur:8.1f}  {name[:100]}")


def measure(arm_spec: str, workload: str, op: str, calls: int, flush_mib: int,
            trace_dir: str = "") -> dict:
    arm = arms.make_arm(arm_spec)
    wl = workloads.get(workload)
    call = arm.setup(wl, op, wl.make_inputs(0))
    for _ in range(3):
        arm.flush(flush_mib)
        arm.sync(call())
    dispatch, total, back_to_back = [], [], []
    for _ in range(calls):
        ms, dispatch_ms = timed_call(arm, call, flush_mib)
        total.append(ms)
        dispatch.append(dispatch_ms)
    for _ in range(calls):
        t0 = time.perf_counter()
        arm.sync(call())
        back_to_back.append((time.perf_counter() - t0) * 1e3)
    if trace_dir:
        timeline(arm, call, trace_dir, flush_mib)
    m = statistics.median
    return {"arm": arm_spec, "dispatch_ms": m(dispatch), "call_ms": m(total),
            "call_min_ms": min(total), "back_to_back_ms": m(back_to_back)}


def main(argv=None) -> list:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profiling.host_time",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="B23", help="one of: " + ", ".join(workloads.names()))
    p.add_argument("--op", default="fwd", choices=("fwd", "fwd+bwd", "ckpt"))
    p.add_argument("--arms", default="cuda", help="comma list of arm specs (benchmarks.run's)")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--flush-mib", type=int, default=256, help="L2 flush before each call (0: none)")
    p.add_argument("--trace", default="", help="directory for a jax.profiler trace of 3 calls")
    a = p.parse_args(argv)
    if a.calls < 1:
        p.error("--calls must be at least 1")
    rows = []
    for spec in a.arms.split(","):
        r = measure(spec, a.workload, a.op, a.calls, a.flush_mib, a.trace)
        print(f"{a.workload} {a.op} {spec}: dispatch {r['dispatch_ms']:.3f} ms, call "
              f"{r['call_ms']:.3f} ms (min {r['call_min_ms']:.3f}), back to back without flush "
              f"{r['back_to_back_ms']:.3f} ms", flush=True)
        rows.append(r)
    return rows


if __name__ == "__main__":
    main()
