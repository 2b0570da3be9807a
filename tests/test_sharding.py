"""gdn and short_conv on sharded arrays (8 CPU devices): per-row document bounds, jit over Explicit
and Auto meshes (batch over data x fsdp, heads over tp), inside jax.shard_map, and the cuda
lowering per shard. Each sharded result equals the one-device result; compiled steps hold no
collective over activations."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh, make_inputs, need_ext, rel_rms
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cake_gdn as J
from jax_cake_gdn.reference import gdn_reference_vjp, short_conv_reference

B, T, H, HV, D, N = 4, 150, 2, 4, 16, 3
BATCH, HEADS = ("data", "fsdp"), "tp"
ACT = P(BATCH, None, HEADS)  # q, k, v, g, beta, o
STATE = P(BATCH, None, HEADS)  # initial / final state [B, N, HV, K, V]
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def row_bounds(rng, rows=B, T=T, n=N):
    """Per-row bounds [rows, n + 1]: uneven lengths, a length-1 document, an empty one."""
    out = []
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(2, T - 1), size=n - 1, replace=False))
        if r == 0:
            cuts[0] = 1
        if r == 1:
            cuts[1] = cuts[0]
        out.append(np.concatenate([[0], cuts, [T]]))
    return np.asarray(out, np.int32)


def flat_bounds(cu):
    """Per-row bounds [B, N + 1] over T as one sequence's over B * T (the reference's form)."""
    rows, T = cu.shape[0], cu[0, -1]
    return np.concatenate([(cu[:, :-1] + T * np.arange(rows)[:, None]).ravel(), [rows * T]])


def problem(rng, dtype=jnp.float32):
    q, k, v, g, beta, h0 = make_inputs(rng, B=B, T=T, H=H, HV=HV, K=D, V=D, dtype=dtype,
                                       num_states=B * N)
    cu = row_bounds(rng)
    do = jnp.asarray(rng.standard_normal((B, T, HV, D)), dtype)
    dfinal = jnp.asarray(rng.standard_normal((B, N, HV, D, D)), jnp.float32)
    return (q, k, v, g, beta, h0.reshape(B, N, HV, D, D)), cu, do, dfinal


def gdn_vjp(q, k, v, g, beta, h0, cu, do, dfinal):
    """(o, final, grads) of sum(o * do) + sum(final * dfinal)."""
    def f(q, k, v, g, beta, h0):
        return J.gdn(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True,
                     backend="xla")

    (o, final), pull = jax.vjp(f, q, k, v, g, beta, h0)
    return o, final, pull((do, dfinal))


def mesh_of(kind):
    return cpu_mesh((2, 2, 2), BATCH + (HEADS,), axis_types=(kind,) * 3)


def collectives(compiled):
    """[(op, elements)] of every collective in a compiled program's HLO."""
    ops = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"
    found = re.findall(rf"= (\w+)\[([\d,]*)\][^ ]* ({ops})(?:-start)?\(", compiled.as_text())
    return [(op, int(np.prod([int(d) for d in dims.split(",") if d]))) for _, dims, op in found]


def spec_of(x):
    s = tuple(x.sharding.spec)
    return s + (None,) * (x.ndim - len(s))


def test_per_row_bounds_match_reference(rng):
    """cu_seqlens [B, N + 1]: each row's documents over its own T tokens, initial and final
    states [B, N, ...]; against the f64 loop over the rows packed into one sequence."""
    args, cu, do, dfinal = problem(rng)
    o, final, grads = jax.jit(gdn_vjp)(*args, jnp.asarray(cu), do, dfinal)
    one = lambda x: np.asarray(x).reshape((1, B * T) + x.shape[2:])
    docs = lambda x: np.asarray(x).reshape((B * N,) + x.shape[2:])
    ro, rfinal, rgrads = gdn_reference_vjp(*map(one, args[:5]), one(do), docs(dfinal),
                                           cu_seqlens=flat_bounds(cu),
                                           initial_state=docs(args[5]))
    assert final.shape == (B, N, HV, D, D)
    errs = {"o": rel_rms(o.reshape(ro.shape), ro),
            "final": rel_rms(final.reshape(rfinal.shape), rfinal)}
    errs.update({n: rel_rms(np.asarray(d).reshape(rgrads[n].shape), rgrads[n])
                 for n, d in zip(NAMES, grads)})
    assert max(errs.values()) <= 1e-5, errs


def test_per_row_bounds_traced_without_retrace(rng):
    """A jitted step takes new per-row bounds without tracing again, and each call equals gdn
    on the rows one at a time."""
    q, k, v, g, beta, _ = make_inputs(rng, B=B, T=T, H=H, HV=HV, K=D, V=D)
    traces = []

    @jax.jit
    def step(cu):
        traces.append(1)
        return J.gdn(q, k, v, g, beta, cu_seqlens=cu, backend="xla")

    one_row = jax.jit(lambda r, cu: J.gdn(*(x[r][None] for x in (q, k, v, g, beta)),
                                          cu_seqlens=cu, backend="xla"))
    for _ in range(2):
        cu = row_bounds(rng)
        o = step(jnp.asarray(cu))
        for r in range(B):
            assert rel_rms(o[r:r + 1], one_row(r, jnp.asarray(cu[r]))) <= 1e-6
    assert len(traces) == 1


@pytest.mark.parametrize("kind", (AxisType.Explicit, AxisType.Auto))
def test_jit_on_mesh(rng, kind):
    """jax.jit(gdn) on batch x head sharded arrays: equal to one device, o and the gradients keep
    the inputs' sharding, and the compiled step holds no collective."""
    args, cu, do, dfinal = problem(rng)
    ref = jax.jit(gdn_vjp)(*args, jnp.asarray(cu), do, dfinal)
    mesh = mesh_of(kind)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    sharded = ([put(x, ACT) for x in args[:5]] + [put(args[5], STATE), put(cu, P(BATCH)),
                                                   put(do, ACT), put(dfinal, STATE)])
    fn = jax.jit(gdn_vjp)
    out = fn(*sharded)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert rel_rms(a, b) <= 1e-6
    o, final, grads = out
    assert spec_of(o) == (BATCH, None, HEADS, None)
    assert spec_of(final) == spec_of(grads[5]) == (BATCH, None, HEADS, None, None)
    assert all(spec_of(d)[:3] == (BATCH, None, HEADS) for d in grads[:5])
    assert collectives(fn.lower(*sharded).compile()) == []


@pytest.mark.parametrize("kind", (AxisType.Explicit, AxisType.Auto))
def test_short_conv_on_mesh(rng, kind):
    """short_conv on batch x channel sharded x (weight's channels with it): equal to one device;
    the one collective sums dweight over the batch shards."""
    C, W = 16, 4
    x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, W)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)
    cu = row_bounds(rng)

    def f(x, w, cu, dy):
        y, pull = jax.vjp(lambda x, w: J.short_conv(x, w, cu_seqlens=cu, backend="xla"), x, w)
        return y, *pull(dy)

    ref = jax.jit(f)(x, w, jnp.asarray(cu), dy)
    assert rel_rms(ref[0].reshape(1, B * T, C),
                   short_conv_reference(x.reshape(1, B * T, C), w,
                                        cu_seqlens=flat_bounds(cu))) <= 1e-6
    mesh = mesh_of(kind)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    args = (put(x, ACT), put(w, P(HEADS)), put(cu, P(BATCH)), put(dy, ACT))
    fn = jax.jit(f)
    out = fn(*args)
    for a, b in zip(out, ref):
        assert rel_rms(a, b) <= 1e-6
    assert spec_of(out[0]) == spec_of(out[1]) == (BATCH, None, HEADS)
    assert all(n <= C * W for _, n in collectives(fn.lower(*args).compile()))


@pytest.mark.parametrize("kind", (AxisType.Explicit, AxisType.Auto))
def test_sharded_token_axis_points_to_gdn_kcp(rng, kind):
    q, k, v, g, beta, _ = make_inputs(rng, B=2, T=64, H=2, HV=2, K=8, V=8)
    mesh = cpu_mesh((8,), ("cp",), axis_types=(kind,))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "cp"))) for x in (q, k, v, g, beta)]
    with pytest.raises(Exception, match="gdn_kcp") as e:
        jax.jit(lambda *a: J.gdn(*a, backend="xla"))(*args)
    if kind == AxisType.Explicit:  # Auto: raised by XLA's partitioner, wrapped
        assert e.type is ValueError and "token axis of q" in str(e.value)


def test_gva_group_stays_on_one_device(rng):
    """Value heads sharded over more devices than there are q/k heads: a clear error."""
    q, k, v, g, beta, _ = make_inputs(rng, B=1, T=64, H=2, HV=8, K=8, V=8)
    mesh = cpu_mesh((4,), ("tp",), axis_types=(AxisType.Explicit,))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, None, "tp")))
    with pytest.raises(ValueError, match=r"v is sharded over mesh axes \('tp',\).*q/k heads H"):
        jax.jit(lambda *a: J.gdn(*a, backend="xla"))(q, k, put(v), put(g), put(beta))


def _grads(args, cu, do, dfinal, x, w, dy):
    """Gradients of <o, do> + <final, dfinal> + <short_conv(x, w), dy> in every input of
    `args` (a dict; initial_state optional), x and w."""
    def loss(a):
        o, final = J.gdn(a["q"], a["k"], a["v"], a["g"], a["beta"],
                         initial_state=a.get("initial_state"), cu_seqlens=cu,
                         output_final_state=True, backend="xla")
        y = J.short_conv(a["x"], a["w"], cu_seqlens=cu, backend="xla")
        return jnp.vdot(o, do) + jnp.vdot(final, dfinal) + jnp.vdot(y, dy)

    return jax.grad(loss)(dict(args, x=x, w=w))


@pytest.mark.parametrize("axis", ("batch", "heads"))
def test_inside_shard_map(rng, axis):
    """gdn and short_conv inside jax.shard_map over the batch (an Auto mesh axis left outside;
    per-row bounds and initial states; w replicated: JAX sums its gradient) or over the heads
    (one packed row, the default zero initial state; w split with the channels): every gradient
    taken inside equals one device."""
    (q, k, v, g, beta, h0), cu, do, dfinal = problem(rng)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    if axis == "heads":
        args = {n: a[:1] for n, a in args.items() if n != "initial_state"}
        cu, do, dfinal = cu[0], do[:1], jnp.zeros((N, HV, D, D))
    C = 8
    x = jnp.asarray(rng.standard_normal((do.shape[0], T, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, 3)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    ax = "s"
    if axis == "batch":  # the shard_map leaves an Auto axis "x" (data parallel x something)
        mesh = cpu_mesh((4, 2), (ax, "x"), axis_types=(AxisType.Auto,) * 2)
        act, row, wspec = P(ax), P(ax), P()
    else:
        mesh, act, row, wspec = cpu_mesh((2,), (ax,)), P(None, None, ax), P(), P(ax)
    state = P(ax) if axis == "batch" else P(None, ax)
    arg_specs = {n: (state if n == "initial_state" else act) for n in args}
    in_specs = (arg_specs, row, act, state, act, wspec, act)
    fn = jax.shard_map(_grads, mesh=mesh, in_specs=in_specs,
                       out_specs=dict(arg_specs, x=act, w=wspec), axis_names={ax})
    inputs = (args, jnp.asarray(cu), do, dfinal, x, w, dy)
    got = jax.jit(fn)(*jax.device_put(inputs, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                           in_specs)))
    ref = jax.jit(_grads)(*inputs)
    assert set(got) == set(args) | {"x", "w"}
    errs = {n: rel_rms(got[n], ref[n]) for n in ref}
    assert max(errs.values()) <= 1e-5, errs


def test_cuda_lowering_per_shard(rng):
    """The cuda custom calls of a sharded jitted step (gdn fwd + bwd, short_conv) and of gdn
    inside shard_map see one device's block: local token and head counts only."""
    need_ext()
    Bc, Tc, Hc, HVc, Dc = 4, 64, 4, 8, 64  # local: 1 row (64 tokens), 2 q/k and 4 value heads
    q, k, v, g, beta, _ = make_inputs(rng, B=Bc, T=Tc, H=Hc, HV=HVc, K=Dc, V=Dc)
    x = jnp.asarray(rng.standard_normal((Bc, Tc, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((16, 4)), jnp.bfloat16)
    mesh = mesh_of(AxisType.Explicit)
    put = lambda a, s, m=mesh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, s))

    def loss(q, k, v, g, beta, x, w):
        o = J.gdn(q, k, v, g, beta, qk_l2norm=True, backend="cuda", save_mode="light")
        y = J.short_conv(x, w, backend="cuda")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(y.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))
    args = [put(a, ACT) for a in (q, k, v, g, beta, x)] + [put(w, P(HEADS))]
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = dict(re.findall(r"custom_call @jax_cake_gdn_(\w+)\(.*?\) .*?-> (.*)", text))
    assert {"walk_output", "walk_chunk_bwd", "conv_fwd", "conv_bwd"} <= set(calls), calls
    assert calls["gate_cumsum"].startswith("tensor<64x4xf32>")  # g [tokens, value heads]
    assert calls["walk_output"].startswith("(tensor<64x4x64xf32>")  # o
    assert calls["conv_fwd"].startswith("tensor<64x8xbf16>")  # y [tokens, channels]
    assert str(Bc * Tc) + "x" not in "".join(calls.values())  # never the global token count

    smesh = cpu_mesh((2,), ("tp",))
    inner = jax.shard_map(lambda *a: jax.grad(lambda *b: jnp.sum(
        J.gdn(*b, backend="cuda").astype(jnp.float32)), argnums=(0, 2))(*a),
        mesh=smesh, in_specs=(P(None, None, "tp"),) * 5, out_specs=(P(None, None, "tp"),) * 2)
    args = [put(a, P(None, None, "tp"), smesh) for a in (q, k, v, g, beta)]
    text = jax.jit(inner).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = dict(re.findall(r"custom_call @jax_cake_gdn_(\w+)\(.*?\) .*?-> (.*)", text))
    assert calls["gate_cumsum"].startswith(f"tensor<{Bc * Tc}x4xf32>"), calls


def _one_device_mesh(rng, axis_type, backend, device):
    """gdn (per-row bounds, gradients) and short_conv under jit on a 1 x 1 mesh of `device`, batch
    and heads 'sharded' over it, equal the same calls without a mesh."""
    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((1, 1), ("data", "tp"), axis_types=(kind, kind), devices=[device])
    Bg, Tg, Hg, HVg, Dg = 2, 700, 2, 4, 64
    q, k, v, g, beta, _ = make_inputs(rng, B=Bg, T=Tg, H=Hg, HV=HVg, K=Dg, V=Dg,
                                      dtype=jnp.bfloat16, qk_l2norm=True)
    cu = jnp.asarray(row_bounds(rng, rows=Bg, T=Tg, n=3))
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.bfloat16)
    f = lambda *a: J.gdn(*a[:5], cu_seqlens=a[5], qk_l2norm=True, backend=backend)
    step = jax.jit(lambda *a: (lambda o, pull: (o, pull(do)))(*jax.vjp(lambda *x: f(*x, a[5]),
                                                                        *a[:5])))
    x = jnp.asarray(rng.standard_normal((Bg, Tg, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    conv = jax.jit(lambda x, w, cu: J.short_conv(x, w, cu_seqlens=cu, backend=backend))
    spec = NamedSharding(mesh, P("data", None, "tp"))
    with jax.set_mesh(mesh):
        got = step(*[jax.device_put(x, spec) for x in (q, k, v, g, beta)],
                   jax.device_put(cu, NamedSharding(mesh, P("data"))))
        got_conv = conv(jax.device_put(x, spec), jax.device_put(w, NamedSharding(mesh, P("tp"))),
                        jax.device_put(cu, NamedSharding(mesh, P("data"))))
    ref = step(q, k, v, g, beta, cu)
    for a, b in zip(jax.tree.leaves((got, got_conv)), jax.tree.leaves((ref, conv(x, w, cu)))):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        assert rel_rms(a, b) <= 1e-3


@pytest.mark.parametrize("axis_type", ("explicit", "auto"))
def test_one_device_mesh(rng, axis_type):
    _one_device_mesh(rng, axis_type, "xla", jax.devices("cpu")[0])


@pytest.mark.parametrize("axis_type", ("explicit", "auto"))
def test_gpu_cuda_under_a_one_device_mesh(rng, axis_type):
    """The cuda path on a one-GPU mesh equals the same calls without a mesh (which
    test_cuda_*.py and test_conv_cuda.py check against f64)."""
    from conftest import need_gpu

    need_gpu()
    _one_device_mesh(rng, axis_type, "cuda", jax.devices("cuda")[0])
