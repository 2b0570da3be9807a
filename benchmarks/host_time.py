"""Host vs device side of one timed call: how long the jitted call takes to return to Python
(dispatch: every launch enqueued) against the call with its sync, as `benchmarks.run` times it.

    python -m benchmarks.host_time --workload B23 --op fwd --arm cuda --calls 30

Per arm: `--calls` calls after an L2 flush (as benchmarks.run), then `--calls` back to back with
no flush. Prints the medians and minima; never asserts on them.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import arms, workloads
from benchmarks.run import make_flush


def measure(arm_spec: str, workload: str, op: str, calls: int, flush_mib: int) -> dict:
    arm = arms.make_arm(arm_spec)
    wl = workloads.get(workload)
    call = arm.setup(wl, op, wl.make_inputs(0))
    flush = make_flush(flush_mib)
    for _ in range(3):
        flush()
        arm.sync(call())
    dispatch, total, back_to_back = [], [], []
    for _ in range(calls):
        flush()
        t0 = time.perf_counter()
        res = call()
        t1 = time.perf_counter()
        arm.sync(res)
        t2 = time.perf_counter()
        dispatch.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    for _ in range(calls):
        t0 = time.perf_counter()
        arm.sync(call())
        back_to_back.append((time.perf_counter() - t0) * 1e3)
    m = statistics.median
    return {"arm": arm_spec, "dispatch_ms": m(dispatch), "call_ms": m(total),
            "call_min_ms": min(total), "back_to_back_ms": m(back_to_back)}


def main(argv=None) -> list:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="B23", help="one of: " + ", ".join(workloads.names()))
    p.add_argument("--op", default="fwd", choices=("fwd", "fwd+bwd", "ckpt"))
    p.add_argument("--arms", default="cuda", help="comma list of arm specs (benchmarks.run's)")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--flush-mib", type=int, default=256, help="L2 flush before each call (0: none)")
    a = p.parse_args(argv)
    if a.calls < 1:
        p.error("--calls must be at least 1")
    rows = []
    for spec in a.arms.split(","):
        r = measure(spec, a.workload, a.op, a.calls, a.flush_mib)
        print(f"{a.workload} {a.op} {spec}: dispatch {r['dispatch_ms']:.3f} ms, call "
              f"{r['call_ms']:.3f} ms (min {r['call_min_ms']:.3f}), back to back without flush "
              f"{r['back_to_back_ms']:.3f} ms", flush=True)
        rows.append(r)
    return rows


if __name__ == "__main__":
    main()
