"""Host vs device side of one timed call: how long the jitted call takes to return to Python
(dispatch: every launch enqueued) against the call with its sync, as `benchmarks.run` times it.

    python -m benchmarks.profiling.host_time --workload B23 --op fwd --arms cuda --calls 30 [--trace DIR]

Per arm: `--calls` calls after an L2 flush (as benchmarks.run), then `--calls` back to back with
no flush. Prints the medians and minima; never asserts on them. `--trace DIR` also records three
flushed calls with `jax.profiler` (JAX arms) and prints the device timeline of the last one:
every kernel with its duration and the idle time before it (the launch gaps that a sum of ncu
kernel times does not show), then that call's host events.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import time

from benchmarks import arms, workloads
from benchmarks.run import make_flush


def trace_events(trace_dir: str) -> tuple:
    """(device, host) events of the newest jax.profiler trace under `trace_dir`, each a sorted
    list of (start_us, dur_us, name): device = the GPU stream threads' events, host = every
    other process's (name prefixed by its thread's). Raises when the trace has no GPU stream."""
    files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not files:
        raise RuntimeError(f"no *.trace.json.gz under {trace_dir}/plugins/profile")
    with gzip.open(max(files, key=os.path.getmtime), "rt") as f:
        events = json.load(f)["traceEvents"]
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    gpu = {p for p, n in pname.items() if "GPU" in n}
    streams = {k for k, n in tname.items() if k[0] in gpu and n.startswith("Stream")}
    if not streams:
        raise RuntimeError("no GPU stream threads in the trace; processes: "
                           + ", ".join(sorted(pname.values())) + "; GPU threads: "
                           + ", ".join(sorted({n for k, n in tname.items() if k[0] in gpu})))
    device, host = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e["pid"], e["tid"])
        if key in streams:
            device.append((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]))
        elif e["pid"] not in gpu:
            host.append((float(e["ts"]), float(e.get("dur", 0.0)),
                         f"[{tname.get(key, e['tid'])}] {e['name']}"))
    return sorted(device), sorted(host)


def timeline(arm, call, flush, trace_dir: str, flush_mib: int) -> None:
    """Trace three flushed calls; print the last call's device events and launch gaps."""
    import jax

    with jax.profiler.trace(trace_dir):
        for _ in range(3):
            flush()
            arm.sync(call())
    ev, host = trace_events(trace_dir)
    # With a flush, the trace starts with the flush kernel and each call follows one.
    start = 0
    if flush_mib > 0:
        flushes = [i for i, e in enumerate(ev) if e[2] == ev[0][2]]
        start = flushes[-1] + 1 if flushes[-1] + 1 < len(ev) else 0
    last = ev[start:]
    t0, busy, prev_end = last[0][0], 0.0, last[0][0]
    print(f"  device timeline of one call ({len(last)} events; us from its first kernel):")
    for ts, dur, name in last:
        print(f"    {ts - t0:9.1f} +{dur:8.1f} (idle {max(ts - prev_end, 0.0):6.1f})  {name[:90]}")
        busy += dur
        prev_end = max(prev_end, ts + dur)
    span = prev_end - t0
    print(f"  span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f}"
          f" ms between them", flush=True)
    # Host side of that call: from the end of the flush before it to the end of its last kernel.
    h0 = ev[start - 1][0] + ev[start - 1][1] if start > 0 else t0 - 2000.0
    rows = [e for e in host if h0 <= e[0] <= prev_end and e[1] >= 5.0]
    print(f"  host events of that call ({len(rows)} of >= 5 us; us from its first kernel):")
    for ts, dur, name in rows[:80]:
        print(f"    {ts - t0:9.1f} +{dur:8.1f}  {name[:100]}")


def measure(arm_spec: str, workload: str, op: str, calls: int, flush_mib: int,
            trace_dir: str = "") -> dict:
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
    if trace_dir:
        timeline(arm, call, flush, trace_dir, flush_mib)
    m = statistics.median
    return {"arm": arm_spec, "dispatch_ms": m(dispatch), "call_ms": m(total),
            "call_min_ms": min(total), "back_to_back_ms": m(back_to_back)}


def main(argv=None) -> list:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profiling.host_time", description=__doc__,
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
