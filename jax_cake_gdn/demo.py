"""A jitted GDN training step on random packed documents: `python -m jax_cake_gdn.demo`.

One Flax NNX `jax_cake_gdn.layers.GatedDeltaNet` layer (the Qwen3-Next / FLA layer shape):
x [1, T, D] -> q/k/v projections -> short causal conv (SiLU) over the packed q|k|v channels ->
gate g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) -> gdn with qk_l2norm -> gated
RMSNorm -> output projection -> MSE against a random target; `jax.value_and_grad` and an SGD
update of the layer's parameters (nnx.split / nnx.merge), all in one jitted step. `cu_seqlens` is
a traced argument of fixed capacity (--docs + 1): every step draws new uneven document lengths
and the step compiles once.

On the first step the gdn output of one short document is checked against the float64 oracle
(`jax_cake_gdn.reference.gdn_reference`) on exactly the inputs the layer gives gdn
(`GatedDeltaNet.gdn_inputs`); the demo exits non-zero when the relative RMS error is above 1e-2
(bf16) or 1e-4 (f32). Tokens/s excludes the first (compiling) step.

    python -m jax_cake_gdn.demo --tokens 2048 --docs 4 --heads 2,4 --head-dim 64 --steps 5

With --generate it runs inference instead: --batch rows of --tokens prompt tokens through the
chunked gdn into the layer's cache (`GatedDeltaNet.init_cache`), then --new-tokens decode steps
with `gdn_step`, each feeding the layer's last output back as the next input (a toy
autoregression: the demo has no vocabulary). It prints prefill and decode tokens/s and checks the
outputs against one chunked pass over the whole sequence.

    python -m jax_cake_gdn.demo --generate --tokens 512 --batch 2 --new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_cake_gdn.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="packed tokens per step (T)")
    p.add_argument("--docs", type=int, default=4,
                   help="documents per step (cu_seqlens capacity - 1)")
    p.add_argument("--heads", default="2,4", help="H,HV: q/k heads, value heads (HV %% H == 0)")
    p.add_argument("--head-dim", type=int, default=64, help="K = V")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--conv-width", type=int, default=4)
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    p.add_argument("--backend", choices=("xla", "cuda"), default=None,
                   help="gdn/short_conv backend (default: the library's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks: gdn_kcp + CP short conv under jax.shard_map "
                        "(on a CPU host the demo forces that many host devices)")
    p.add_argument("--layout", choices=("contiguous", "zigzag", "doc_zigzag"),
                   default="contiguous", help="CP token layout (with --cp > 1)")
    p.add_argument("--generate", action="store_true",
                   help="inference: prefill --tokens per row, then --new-tokens decode steps")
    p.add_argument("--batch", type=int, default=2, help="rows (sequences) with --generate")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps with --generate")
    a = p.parse_args(argv)
    try:
        a.H, a.HV = (int(s) for s in a.heads.split(","))
    except ValueError:
        p.error(f"--heads must be H,HV (got {a.heads!r})")
    if a.H < 1 or a.HV % a.H:
        p.error(f"--heads: HV ({a.HV}) must be a positive multiple of H ({a.H})")
    if a.docs < 1 or a.tokens < a.docs:
        p.error("need --docs >= 1 and --tokens >= --docs")
    if a.steps < 1:
        p.error("--steps must be >= 1")
    if a.cp < 1:
        p.error("--cp must be >= 1")
    if a.generate and (a.cp > 1 or a.batch < 1 or a.new_tokens < 1):
        p.error("--generate needs --cp 1, --batch >= 1 and --new-tokens >= 1")
    parts = a.cp if a.layout == "contiguous" else 2 * a.cp
    if a.cp > 1 and a.tokens % parts:
        p.error(f"--tokens must be a multiple of {parts} for --cp {a.cp} --layout {a.layout}")
    return a


def random_cu_seqlens(rng, T, N, unit=1):
    """N uneven document lengths (each >= unit, multiples of unit) summing to T, as cu_seqlens
    [N+1] int32."""
    n = T // unit
    cuts = np.sort(rng.choice(np.arange(1, n), size=N - 1, replace=False)) if N > 1 else []
    return (np.concatenate([[0], cuts, [n]]) * unit).astype(np.int32)


class Progress:
    """A plain stderr progress bar (no dependency)."""

    def __init__(self, total, enabled, width=30):
        self.total, self.enabled, self.width, self.t0 = total, enabled, width, time.perf_counter()

    def update(self, i, msg=""):
        if not self.enabled:
            return
        n = int(self.width * i / self.total)
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{'#' * n}{'.' * (self.width - n)}] {i}/{self.total} {el:6.1f}s {msg}")
        if i == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def main(argv=None):
    args = parse_args(argv)

    if args.generate:
        return generate(args)
    if args.cp > 1:  # CPU hosts get that many host devices (must precede the jax import)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.cp}")

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_cake_gdn as jcg
    from jax_cake_gdn.layers import GatedDeltaNet
    from jax_cake_gdn.reference import gdn_reference

    T, N, H, HV = args.tokens, args.docs, args.H, args.HV
    K, D, W = args.head_dim, args.d_model, args.conv_width
    dt = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    dev = jax.devices()[0]
    try:  # which primitive set backend=None / --backend resolves to (the library's own rule)
        from jax_cake_gdn import primitives as _prims

        resolved = _prims.resolve(args.backend, K=args.head_dim, V=args.head_dim).name
    except (ImportError, AttributeError):
        resolved = "?"
    except Exception as e:  # noqa: BLE001 - e.g. backend="cuda" without the extension
        print(f"error: --backend {args.backend}: {e}", file=sys.stderr)
        return 1
    print(f"device: {dev.platform} ({dev.device_kind}); backend: {args.backend or 'default'} "
          f"-> {resolved}; T={T} docs={N} heads=({H},{HV}) K=V={K} d_model={D} "
          f"dtype={args.dtype} steps={args.steps}")

    # ---- the layer (float32 parameters, `dtype` activations) and data ----
    layer = GatedDeltaNet(D, num_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=K,
                          conv_size=W, dtype=dt, backend=args.backend,
                          rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(layer)  # params: a pytree (nnx.State) the jitted step updates
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(f"layer: GatedDeltaNet(hidden={D}, heads=({H},{HV}), K=V={K}, conv {W}), "
          f"{n_params:,} parameters")
    ks = jax.random.split(jax.random.PRNGKey(args.seed + 1), 2)
    x = jax.random.normal(ks[0], (1, T, D), jnp.float32).astype(dt)
    target = jax.random.normal(ks[1], (1, T, D), jnp.float32)
    rng = np.random.default_rng(args.seed)

    R = args.cp
    cp = dict(axis_name="cp", layout=args.layout) if R > 1 else dict(axis_name=None)
    unit = 2 * R if (R > 1 and args.layout == "doc_zigzag") else 1

    def gdn_probe(p, x, cu):  # what the layer hands gdn, and what gdn returns
        m = nnx.merge(graphdef, p)
        ins = m.gdn_inputs(x, cu, **cp)
        return m.gdn_output(*ins, cu_seqlens=cu, **cp), ins

    def loss_fn(p, x, target, cu):
        y = nnx.merge(graphdef, p)(x, cu_seqlens=cu, **cp)
        sq = jnp.sum((y.astype(jnp.float32) - target) ** 2)
        return (jax.lax.psum(sq, "cp") if R > 1 else sq) / (T * D)

    def step(p, x, target, cu):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, target, cu)  # CP: grads summed by JAX
        return jax.tree.map(lambda a, b: a - args.lr * b, p, grads), loss

    if R > 1:  # one mesh axis over R devices; tokens in layout order, sharded over it
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        if len(jax.devices()) < R:
            print(f"error: --cp {R} needs {R} devices, found {len(jax.devices())}",
                  file=sys.stderr)
            return 1
        mesh = jax.make_mesh((R,), ("cp",), devices=jax.devices()[:R])
        tok, rep = NamedSharding(mesh, P(None, "cp")), NamedSharding(mesh, P())
        step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(None, "cp"), P(None, "cp"), P()),
                             out_specs=(P(), P()))
        probe_fn = jax.shard_map(gdn_probe, mesh=mesh, in_specs=(P(), P(None, "cp"), P()),
                                 out_specs=P(None, "cp"))
        place = lambda a, cu: jax.device_put(jcg.to_layout(a, cu, args.layout, R), tok)
        unplace = lambda a, cu: np.asarray(jcg.from_layout(a, cu, args.layout, R))
        params = jax.device_put(params, rep)
        replicated = lambda a: jax.device_put(a, rep)
    else:
        place = unplace = lambda a, cu: a
        replicated = lambda a: a
        probe_fn = gdn_probe
    print(f"context parallel: {R} ranks, layout {args.layout}" if R > 1 else
          "context parallel: off (--cp 1)")

    traces = []

    @jax.jit
    def train_step(p, x, target, cu):
        traces.append(1)  # Python side effect: runs once per trace
        return step(p, x, target, cu)

    probe = jax.jit(probe_fn)

    # ---- one-time check of this step's gdn output on one short document ----
    cu0 = random_cu_seqlens(rng, T, N, unit)
    cu0_j = jnp.asarray(cu0)
    try:
        o, (q, k, v, g, beta) = probe(params, place(x, cu0_j), replicated(cu0_j))
        o, q, k, v, g, beta = (unplace(t, cu0_j) for t in (o, q, k, v, g, beta))
        jax.block_until_ready(o)
    except Exception as e:  # noqa: BLE001 - a backend that cannot run here fails at its first call
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: the layer failed on {dev.platform} with backend "
              f"{args.backend or 'default'}: "
              f"{type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    lens = np.diff(cu0)
    d = int(np.argmin(lens))
    a = int(cu0[d])
    b = a + min(int(lens[d]), 256)  # a prefix of a document is itself a document
    sl = lambda t: np.asarray(t[:, a:b], np.float32)
    o_ref, _ = gdn_reference(sl(q), sl(k), sl(v), sl(g), sl(beta), qk_l2norm=True)
    err = float(np.linalg.norm(sl(o).astype(np.float64) - o_ref)
                / max(np.linalg.norm(o_ref), 1e-30))
    tol = 1e-2 if args.dtype == "bf16" else 1e-4
    ok = bool(np.isfinite(err)) and err < tol
    print(f"check: gdn output of doc {d} (its first {b - a} of {int(lens[d])} tokens, packed "
          f"positions {a}:{b}) vs float64 reference: "
          f"rel RMS {err:.2e} (tol {tol:.0e}) {'OK' if ok else 'FAILED'}")
    if not ok:
        return 1

    # ---- training ----
    bar = Progress(args.steps, enabled=args.steps > 3)
    losses, t_first = [], None
    cu = cu0
    for i in range(args.steps):
        if i:
            cu = random_cu_seqlens(rng, T, N, unit)
        cu_j = jnp.asarray(cu)
        params, loss = train_step(params, place(x, cu_j), place(target, cu_j), replicated(cu_j))
        losses.append(float(loss))  # blocks
        if i == 0:
            t_first = time.perf_counter()
        bar.update(i + 1, f"loss {losses[-1]:.4f}")
    t_end = time.perf_counter()

    if not all(np.isfinite(losses)):
        print(f"error: non-finite loss {losses}", file=sys.stderr)
        return 1
    print(f"loss: first {losses[0]:.5f} last {losses[-1]:.5f}; step compiled {len(traces)} time(s) "
          f"for {args.steps} steps with changing document boundaries")
    if args.steps > 1:
        tps = T * (args.steps - 1) / (t_end - t_first)
        print(f"throughput: {tps:,.0f} tokens/s ({(t_end - t_first) / (args.steps - 1) * 1e3:.1f} "
              f"ms/step over {args.steps - 1} steps after the compiling one)")
    else:
        print("throughput: n/a (only the compiling step ran; use --steps > 1)")
    return 0


def generate(args):
    """--generate: prefill with the chunked gdn into the cache, then decode with gdn_step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_cake_gdn.layers import GatedDeltaNet

    B, T, n_new, D = args.batch, args.tokens, args.new_tokens, args.d_model
    dt = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    layer = GatedDeltaNet(D, num_heads=args.H, num_v_heads=args.HV, head_k_dim=args.head_dim,
                          head_v_dim=args.head_dim, conv_size=args.conv_width, dtype=dt,
                          backend=args.backend, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(layer)
    dev = jax.devices()[0]
    print(f"device: {dev.platform} ({dev.device_kind}); generate: batch {B}, prompt {T} tokens, "
          f"{n_new} new tokens; heads=({args.H},{args.HV}) K=V={args.head_dim} d_model={D} "
          f"dtype={args.dtype}")

    def run(p, x, cache, mode):
        return nnx.merge(graphdef, p)(x, cache=cache, mode=mode)

    prefill = jax.jit(lambda p, x, c: run(p, x, c, "chunk"))
    decode = jax.jit(lambda p, x, c: run(p, x, c, "recurrent"))
    whole = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    prompt = jax.random.normal(jax.random.PRNGKey(args.seed + 1), (B, T, D), jnp.float32)
    prompt = prompt.astype(dt)
    cache0 = layer.init_cache(B)
    jax.block_until_ready(prefill(params, prompt, cache0))  # compile
    t0 = time.perf_counter()
    y, cache = jax.block_until_ready(prefill(params, prompt, cache0))
    t_prefill = time.perf_counter() - t0

    def next_input(y):  # the last output, RMS-normalised, is the next token's input
        y = y[:, -1:].astype(jnp.float32)
        return (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(dt)

    inputs, outputs = [prompt], [y]
    t_first = None
    for i in range(n_new):
        x = next_input(outputs[-1])
        y, cache = jax.block_until_ready(decode(params, x, cache))
        inputs.append(x)
        outputs.append(y)
        if i == 0:
            t_first = time.perf_counter()  # the first step compiles
    t_end = time.perf_counter()

    # the same tokens in one chunked pass
    ref = whole(params, jnp.concatenate(inputs, axis=1)).astype(jnp.float32)
    got = jnp.concatenate(outputs, axis=1).astype(jnp.float32)
    err = float(jnp.linalg.norm(got - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
    tol = 1e-2 if args.dtype == "bf16" else 1e-4
    ok = bool(np.isfinite(err)) and err < tol
    print(f"check: prefill + {n_new} decode steps vs one chunked pass over all {T + n_new} "
          f"tokens: rel RMS {err:.2e} (tol {tol:.0e}) {'OK' if ok else 'FAILED'}")
    print(f"prefill: {B * T / t_prefill:,.0f} tokens/s ({t_prefill * 1e3:.1f} ms for {B} x {T} "
          f"tokens, compiled beforehand)")
    if n_new > 1:
        step = (t_end - t_first) / (n_new - 1)
        print(f"decode: {B / step:,.0f} tokens/s ({step * 1e3:.2f} ms per step of {B} row(s), "
              f"over {n_new - 1} steps after the compiling one)")
    else:
        print("decode: n/a (only the compiling step ran; use --new-tokens > 1)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
