"""Where a call's device time goes, kernel by kernel (jax.profiler), for gdn or gdn_kcp on one
device at chosen unit counts.

    python -m benchmarks.profiling.breakdown --workload long --ops fwd,fwd+bwd --segments 1,2,4

Per op and P: the median over `--calls` profiled calls (each after an L2 flush) of each kernel's
summed time, the total, and the share of the transfer kernels. P = 0 means gdn_kcp at W = 1 with
its planned P (under a one-device mesh). `--timeline` also lists the last call's device
activities in start order (start and end from the first one's start, duration, the idle time
before each or, negative, its overlap with the ones before it), to see what runs serially.
Prints tables (progress on stderr); no file is written.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import tempfile

from benchmarks.run import log as _log  # progress lines on stderr, as the harness prints them


def _short(name: str) -> str:
    """A kernel's name without its template arguments (walk_fwd_wg_kernel<kTransfer, ...>)."""
    for key in ("walk_fwd_wg", "walk_bwd_wg", "chunk_bwd", "prep", "gate_cumsum", "l2norm",
                "nan_unless", "conv"):
        if key in name:
            mode = ""
            if key == "walk_fwd_wg":  # mangled ...WalkModeE4E... or demangled (...WalkMode)4
                m = re.search(r"WalkModeE(\d)|WalkMode\)(\d)", name)
                modes = ("tapes", "replay", "out", "out_tapes", "transfer")
                mode = f"[{modes[int(m.group(1) or m.group(2))]}]" if m else ""
            if key == "walk_bwd_wg":  # the last template argument, kTwin
                mode = "[twin]" if re.search(r"Lb1E|, true>", name) else ""
            return key + mode
    return name[:40]


def timeline_rows(events) -> list[str]:
    """One line per device event (start_us, dur_us, name), in start order: its start and end in
    us from the first start, its duration, and the gap since the latest end before it (negative:
    it overlaps what ran before), then its name (template arguments cut)."""
    rows, t0, end = [], None, None
    for ts, dur, name in sorted(events):
        t0 = ts if t0 is None else t0
        gap = 0.0 if end is None else ts - end
        rows.append(f"{ts - t0:10.1f} {ts - t0 + dur:10.1f} {dur:9.1f} {gap:8.1f}  "
                    f"{name.split('<')[0][:70]}")
        end = ts + dur if end is None else max(end, ts + dur)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.profiling.breakdown",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="B23")
    p.add_argument("--ops", default="fwd,fwd+bwd")
    p.add_argument("--segments", default="1,2,4", help="P values (0: gdn_kcp planned, W = 1)")
    p.add_argument("--save-mode", default="full")
    p.add_argument("--deterministic", action="store_true",
                   help="gdn(deterministic=True): dq, dk per value head, no atomic group sums")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--backend", default="cuda", help="cuda, or xla (no device events on a CPU)")
    p.add_argument("--timeline", action="store_true",
                   help="also list the last call's device activities in start order")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cake_gdn as J
    from benchmarks import frameworks, traces
    from benchmarks import workloads

    wl = workloads.get(a.workload)
    inp = wl.make_inputs(0)
    act = jnp.bfloat16
    args = [jnp.asarray(inp[n]).astype(act if n in "qkv" else jnp.float32)
            for n in ("q", "k", "v", "g", "beta")]
    cu = jnp.asarray(inp["cu_seqlens"], jnp.int32)
    do = jnp.asarray(inp["do"]).astype(act)
    kw = dict(qk_l2norm=wl.qk_l2norm, save_mode=a.save_mode, backend=a.backend,
              deterministic=a.deterministic)
    mesh = jax.make_mesh((1,), ("cp",), devices=jax.devices()[:1])

    tok, rep = NamedSharding(mesh, P(None, "cp")), NamedSharding(mesh, P())
    on_mesh = [jax.device_put(x, tok) for x in args] + [jax.device_put(cu, rep)]

    def op_fn(P_, op):
        """(jitted call, its arguments)."""
        if P_ > 0:
            f = lambda *x: J.gdn(*x[:5], cu_seqlens=x[5], segments=P_, **kw)
            xs = args + [cu]
        else:
            f = jax.shard_map(lambda *x: J.gdn_kcp(*x[:5], cu_seqlens=x[5], axis_name="cp",
                                                   **kw),
                              mesh=mesh, in_specs=(P(None, "cp"),) * 5 + (P(),),
                              out_specs=P(None, "cp"))
            xs = on_mesh
        if op == "fwd":
            return jax.jit(f), xs
        grad = lambda *x: (lambda o, pull: (o, pull(do.reshape(o.shape))))(
            *jax.vjp(lambda *y: f(*y, x[5]), *x[:5]))
        return jax.jit(grad), xs

    rows = []
    for op in a.ops.split(","):
        for P_ in (int(x) for x in a.segments.split(",")):
            label = f"{a.workload} {op} P={P_ or 'kcp planned'}"
            _log(f"{label}: compiling and a first call")
            fn, xs = op_fn(P_, op)
            jax.block_until_ready(fn(*xs))
            _log(f"{label}: {a.calls} profiled calls")
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d):
                    for i in range(a.calls):
                        frameworks.jax_flush(256)
                        with jax.profiler.TraceAnnotation(traces.call_label(i)):
                            jax.block_until_ready(fn(*xs))
                device, host = traces.jax_events(traces.load(d))
            ranges = traces.call_ranges(host)
            per = collections.defaultdict(list)
            for i in range(a.calls):
                got = collections.Counter()
                for _, dur, name in traces.in_range(device, ranges[i]):
                    got[_short(name)] += dur / 1e3
                for name, ms in got.items():
                    per[name].append(ms)
            med = {n: statistics.median(v) for n, v in per.items()}
            total = sum(med.values())
            xfer = sum(v for n, v in med.items() if "transfer" in n or "twin" in n)
            rows.append((op, P_, total, xfer, med))
            print(f"{label}: device {total:.3f} ms, "
                  f"transfer + twin {xfer:.3f} ms", flush=True)
            for n, v in sorted(med.items(), key=lambda x: -x[1]):
                print(f"    {n:28s} {v:8.3f}")
            if a.timeline and a.calls > 0:
                print("  last call (us):")
                print(f"  {'start':>10s} {'end':>10s} {'dur':>9s} {'gap':>8s}  name")
                for row in timeline_rows(traces.in_range(device, ranges[a.calls - 1])):
                    print("  " + row)
    return rows


if __name__ == "__main__":
    main()
