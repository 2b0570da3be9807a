"""Per-primitive times of one backend on a workload: where the time of gdn's fwd and bwd goes.

    python -m benchmarks.profiling.kernels --workload B23 [--backend cuda] [--calls 20] [--out DIR]
                                           [--base] [--only REGEX]

Each primitive runs as its own jitted call on inputs precomputed by the same backend (the
intermediates of one light forward and one full backward), median of `--calls` calls after two
warm-up calls, each call synchronised (block_until_ready). The times therefore include one
dispatch each (tens of microseconds) and no L2 flush; they are for finding where the time goes,
not for comparing with peers (benchmarks/run.py does that). The last rows time the whole
forward (light, full) and fwd+bwd the same way, for the sum check.

--base also times the baseline copy of benchmarks/baseline.py ($JCG_BASELINE) in the same
process: each row then runs `--calls` rounds of one current and one baseline call, alternating
which goes first, and reports each copy's median, the median of the per-round ratios baseline /
current with their quartiles (drift over the run cancels within a round; a quartile range that
holds 1.00 means no measured difference), and whether the two gave bit-identical outputs (else
the largest difference relative to the baseline's largest magnitude). Each copy feeds a
primitive its own intermediates, so below the first row that differs the inputs differ too.
Rows pair by name; a row the baseline lacks is timed for the current copy alone.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import time

import numpy as np


def _median_ms(fn, *args, calls):
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def _paired_ms(fn, a, fb, ab, *, calls):
    """Rounds of one call each of two functions (fn first in even rounds, fb first in odd ones),
    each call synchronised: (median ms of fn, of fb, and the median, 25th and 75th percentile of
    the per-round ratio fb / fn)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*a))
        jax.block_until_ready(fb(*ab))
    t = {0: [], 1: []}
    for r in range(calls):
        for arm in ((0, 1) if r % 2 == 0 else (1, 0)):
            f, x = (fn, a) if arm == 0 else (fb, ab)
            t0 = time.perf_counter()
            jax.block_until_ready(f(*x))
            t[arm].append(time.perf_counter() - t0)
    cur, base = np.asarray(t[0]), np.asarray(t[1])
    ratio = base / cur
    return (float(np.median(cur) * 1e3), float(np.median(base) * 1e3),
            tuple(float(np.percentile(ratio, p)) for p in (50, 25, 75)))


def compare_outputs(cur, base) -> str:
    """'same bits', or 'differs (max rel X)' over all output arrays of two calls."""
    import jax

    xs, ys = jax.tree_util.tree_leaves(cur), jax.tree_util.tree_leaves(base)
    if len(xs) != len(ys):
        return f"differs ({len(xs)} vs {len(ys)} outputs)"
    worst, same = 0.0, True
    for x, y in zip(xs, ys):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"differs (shape/dtype {x.shape} {x.dtype} vs {y.shape} {y.dtype})"
        if x.tobytes() == y.tobytes():
            continue
        same = False
        xf, yf = x.astype(np.float64), y.astype(np.float64)
        scale = float(np.max(np.abs(yf[np.isfinite(yf)]), initial=0.0)) or 1.0
        diff = np.abs(xf - yf)
        d = float(np.max(np.where(np.isnan(diff), np.inf, diff), initial=0.0))
        worst = max(worst, d / scale)
    return "same bits" if same else f"differs (max rel {worst:.1e})"


def primitive_calls(wl, backend: str, lib=None):
    """[(name, jitted fn, args)] for every primitive of one gdn fwd + bwd on `wl`'s inputs, of
    the library `lib` (default jax_cake_gdn)."""
    import importlib

    import jax
    import jax.numpy as jnp

    if lib is None:
        import jax_cake_gdn as lib
    primitives = importlib.import_module(lib.__name__ + ".primitives")
    chunk_table = importlib.import_module(lib.__name__ + ".chunks").chunk_table

    if wl.layer:
        raise ValueError("per-primitive times are for the gdn workloads (no -layer)")
    P = primitives.resolve(backend, K=wl.K, V=wl.V)
    inp = wl.make_inputs(seed=0)
    act = jnp.bfloat16 if wl.dtype == "bf16" else jnp.float32
    q, k, v, do = (jnp.asarray(inp[n][0]).astype(act) for n in ("q", "k", "v", "do"))
    g, beta = jnp.asarray(inp["g"][0]), jnp.asarray(inp["beta"][0])
    T = wl.T
    ct = jax.jit(chunk_table, static_argnums=1)(jnp.asarray(inp["cu_seqlens"]), T)
    h0 = jnp.zeros((wl.N, wl.HV, wl.K, wl.V), jnp.float32)
    dfinal = jnp.zeros_like(h0)
    scale = wl.K ** -0.5
    rq = jax.jit(P.l2norm_rstd)(q) if wl.qk_l2norm else None
    rk = jax.jit(P.l2norm_rstd)(k) if wl.qk_l2norm else None
    G = jax.jit(P.gate_cumsum)(g, ct)
    A, w, u = jax.jit(P.prep)(k, v, beta, G, rk, ct)
    h, vn, _ = jax.jit(P.state_walk)(k, w, u, G, h0, rk, ct)

    def out(q, k, G, h, vn, rq, rk, ct):
        return P.output(q, k, G, h, vn, rq, rk, ct, scale=scale, out_dtype=act)

    if hasattr(P, "solve_a"):  # the light forward: solve_a, then walk_output from A
        def walk_out(q, k, v, beta, A, G, h0, rq, rk, ct):
            return P.walk_output(q, k, v, beta, A, G, h0, rq, rk, ct, scale=scale,
                                 out_dtype=act)

        light = [("fwd light: solve_a", jax.jit(P.solve_a), (k, beta, G, rk, ct)),
                 ("fwd light: walk_output", jax.jit(walk_out),
                  (q, k, v, beta, A, G, h0, rq, rk, ct))]
    else:  # a baseline from before solve_a: prep's w, u into walk_output
        def walk_out(q, k, w, u, G, h0, rq, rk, ct):
            return P.walk_output(q, k, w, u, G, h0, rq, rk, ct, scale=scale, out_dtype=act)

        light = [("fwd light: walk_output", jax.jit(walk_out), (q, k, w, u, G, h0, rq, rk, ct))]
    full = []
    if "tapes" in inspect.signature(P.walk_output).parameters:  # the full forward's walk
        def walk_tapes(q, k, v, beta, A, G, h0, rq, rk, ct):
            return P.walk_output(q, k, v, beta, A, G, h0, rq, rk, ct, scale=scale,
                                 out_dtype=act, tapes=True)

        full = [("fwd full: walk_output, tapes", jax.jit(walk_tapes),
                 (q, k, v, beta, A, G, h0, rq, rk, ct))]

    def wbwd(q, k, w, G, do, dfinal, rq, rk, ct):
        return P.walk_bwd(q, k, w, G, do, dfinal, None, rq, rk, ct, scale=scale)

    wb = jax.jit(wbwd)(q, k, w, G, do, dfinal, rq, rk, ct)
    # what chunk_bwd takes from walk_bwd: dS_end, and each chunk's dvn where walk_bwd makes it
    # (baselines before: dS_end alone)
    takes_dvn = "dvn" in inspect.signature(P.chunk_bwd).parameters
    from_walk = (wb[0], wb[2]) if takes_dvn else (wb[0],)

    def cbwd(q, k, v, beta, G, A, w, u, h, vn, from_walk, do, rq, rk, ct, **kw):
        return P.chunk_bwd(q, k, v, beta, G, A, w, u, h, vn, None, *from_walk, do, rq, rk, ct,
                           scale=scale, **kw)

    calls = []
    if wl.qk_l2norm:
        calls.append(("fwd: l2norm_rstd (q or k)", jax.jit(P.l2norm_rstd), (k,)))
    calls += [
        ("fwd: gate_cumsum", jax.jit(P.gate_cumsum), (g, ct)),
        *light,
        *full,
        # kcp's transfer walk (prep, state_walk); the output kernel from h, v_new
        ("transfer walk: prep", jax.jit(P.prep), (k, v, beta, G, rk, ct)),
        ("transfer walk: state_walk", jax.jit(P.state_walk), (k, w, u, G, h0, rk, ct)),
        ("output from h, v_new", jax.jit(out), (q, k, G, h, vn, rq, rk, ct)),
        ("bwd: walk_bwd", jax.jit(wbwd), (q, k, w, G, do, dfinal, rq, rk, ct)),
        ("bwd: chunk_bwd", jax.jit(cbwd), (q, k, v, beta, G, A, w, u, h, vn, from_walk, do, rq,
                                           rk, ct)),
    ]
    if "deterministic" in inspect.signature(P.chunk_bwd).parameters:
        def cbwd_sum(*a):
            return cbwd(*a, deterministic=False)

        calls.append(("bwd: chunk_bwd, atomic group sum", jax.jit(cbwd_sum),
                      (q, k, v, beta, G, A, w, u, h, vn, from_walk, do, rq, rk, ct)))
    if hasattr(P, "replay"):  # the light backward's replay (baselines before it lack it)
        calls.append(("bwd light: replay", jax.jit(P.replay), (k, v, beta, G, A, h0, rk, ct)))
    return calls


def whole_op_calls(wl, backend: str, lib=None):
    """[(name, fn, args)] for gdn fwd (light, full) and fwd+bwd (light, full) on `wl`."""
    from ..arms import _jax_inputs, build_jax_op

    inp = wl.make_inputs(seed=0)
    dev = _jax_inputs(wl, inp)
    rows = []
    for op in ("fwd", "fwd+bwd"):
        for mode in ("light", "full"):
            fn, names = build_jax_op(wl, op, backend=backend, save_mode=mode, lib=lib)
            rows.append((f"gdn {op} {mode}", fn,
                         (tuple(dev[n] for n in names), dev["do"], dev["cu_seqlens"])))
    return rows


def main(argv=None):
    from .. import workloads

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="B23",
                    choices=[n for n in workloads.names() if not n.endswith("-layer")])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "xla"))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None, help="directory for kernels_<workload>_<backend>.json")
    ap.add_argument("--base", action="store_true",
                    help="also time the baseline copy ($JCG_BASELINE, benchmarks/baseline.py)")
    ap.add_argument("--only", default="", help="time only the rows whose name matches this regex")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls must be >= 1")

    import jax

    wl = workloads.get(args.workload)
    rows, base_rows, base_rev, base_equal, base_ratio = {}, {}, None, {}, {}
    print(f"[kernels] {wl.name} backend={args.backend} device={jax.devices()[0]}", flush=True)
    cur = [row for row in primitive_calls(wl, args.backend) + whole_op_calls(wl, args.backend)
           if re.search(args.only, row[0])]
    if args.base:
        from .. import baseline

        lib, base_rev = baseline.load()
        base = primitive_calls(wl, args.backend, lib) + whole_op_calls(wl, args.backend, lib)
        print(f"[kernels] baseline {baseline.BASE} (revision {base_rev}): {args.calls} rounds "
              f"of current and baseline per row, alternating; base/current is the median "
              f"per-round ratio [quartiles]", flush=True)
        base = {name: (fb, ab) for name, fb, ab in base}
        for name, fn, a in cur:
            if name not in base:  # a primitive the baseline does not have
                rows[name] = _median_ms(fn, *a, calls=args.calls)
                print(f"  {name:32s} {rows[name]:9.3f} ms  (not in the baseline)", flush=True)
                continue
            fb, ab = base[name]
            rows[name], base_rows[name], q = _paired_ms(fn, a, fb, ab, calls=args.calls)
            base_ratio[name] = q
            base_equal[name] = compare_outputs(fn(*a), fb(*ab))
            print(f"  {name:32s} {rows[name]:9.3f} ms  base {base_rows[name]:9.3f} ms  "
                  f"base/current {q[0]:5.2f} [{q[1]:4.2f}, {q[2]:4.2f}]  {base_equal[name]}",
                  flush=True)
    else:
        for name, fn, a in cur:
            rows[name] = _median_ms(fn, *a, calls=args.calls)
            print(f"  {name:32s} {rows[name]:9.3f} ms", flush=True)
    res = dict(workload=wl.describe(), backend=args.backend, device=str(jax.devices()[0]),
               calls=args.calls, median_ms=rows)
    if args.base:
        res.update(base_revision=base_rev, base_median_ms=base_rows, base_outputs=base_equal,
                   base_ratio_median_q25_q75=base_ratio)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"kernels_{wl.name}_{args.backend}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"[kernels] wrote {path}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
