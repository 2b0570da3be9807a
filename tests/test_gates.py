"""FLA gate options (use_gate_in_kernel + A_log/dt_bias, use_beta_sigmoid_in_kernel,
allow_neg_eigval): gdn and gdn_kcp equal the op called with gates computed here, independently."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh, make_inputs, rel_rms, uneven_cu_seqlens
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cake_gdn as J

NAMES = ("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias")
OPTIONS = {  # every branch: gate with / without dt_bias, sigmoid with / without the factor 2
    "gate_no_bias": dict(use_gate_in_kernel=True, dt_bias=None),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "all": dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
}


def ref_gate(g_raw, A_log, dt_bias):
    """FLA's naive_gdn_gate: -exp(A_log) * softplus(g_raw + dt_bias), written out here."""
    x = g_raw if dt_bias is None else g_raw + dt_bias[None, None, :]
    return -jnp.exp(A_log)[None, None, :] * jnp.logaddexp(x, 0.0)


def ref_beta(b_raw, allow_neg_eigval):
    s = 1.0 / (1.0 + jnp.exp(-b_raw))
    return 2.0 * s if allow_neg_eigval else s


def raw_inputs(rng, T, HV=4, **kw):
    """q, k, v as usual; raw gate inputs and logits ~ N(0, 1); A_log = log U(1, 4);
    dt_bias ~ N(-1, 1)."""
    q, k, v, _, _, _ = make_inputs(rng, T=T, HV=HV, **kw)
    g_raw = jnp.asarray(rng.standard_normal((1, T, HV)), jnp.float32)
    b_raw = jnp.asarray(rng.standard_normal((1, T, HV)), jnp.float32)
    A_log = jnp.asarray(np.log(rng.uniform(1.0, 4.0, HV)), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(HV) - 1.0, jnp.float32)
    return q, k, v, g_raw, b_raw, A_log, dt_bias


def split(opts):
    """(gdn kwargs with A_log/dt_bias taken from the arguments, uses_dt_bias)."""
    opts = dict(opts)
    use_dt = opts.pop("dt_bias", True) is not None
    return opts, use_dt


def with_options(op, opts):
    """f(q, k, v, g_raw, b_raw, A_log, dt_bias) -> op(..., gate options); A_log/dt_bias unused
    (zero gradient) when the option does not take them."""
    kw, use_dt = split(opts)

    def f(q, k, v, g, b, A_log, dt_bias):
        if kw.get("use_gate_in_kernel"):
            return op(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias if use_dt else None, **kw)
        return op(q, k, v, g, b, **kw)
    return f


def with_reference(op, opts):
    """The same function with the gates computed by ref_gate / ref_beta above."""
    kw, use_dt = split(opts)

    def f(q, k, v, g, b, A_log, dt_bias):
        if kw.get("use_gate_in_kernel"):
            g = ref_gate(g, A_log, dt_bias if use_dt else None)
        if kw.get("use_beta_sigmoid_in_kernel"):
            b = ref_beta(b, kw.get("allow_neg_eigval", False))
        return op(q, k, v, g, b)
    return f


def assert_same(got, ref, label):
    (o, grads), (ro, rgrads) = got, ref
    errs = {"o": rel_rms(o, ro)}
    for n, a, b in zip(NAMES, grads, rgrads):
        b = np.asarray(b)
        errs[n] = 0.0 if not np.any(b) and not np.any(np.asarray(a)) else rel_rms(a, b)
    assert all(e <= 1e-6 for e in errs.values()), (label, errs)
    return errs


@pytest.mark.parametrize("name", list(OPTIONS))
def test_gdn_options_equal_reference_gates(rng, name):
    T = 150
    cu = jnp.asarray(uneven_cu_seqlens(rng, T))
    args = raw_inputs(rng, T, H=2, K=16, V=16)
    do = jnp.asarray(rng.standard_normal((1, T, 4, 16)), jnp.float32)
    op = functools.partial(J.gdn, cu_seqlens=cu, backend="xla")

    def run(f):
        o, pull = jax.vjp(f, *args)
        return o, pull(do)

    got = jax.jit(lambda: run(with_options(op, OPTIONS[name])))()
    ref = jax.jit(lambda: run(with_reference(op, OPTIONS[name])))()
    assert_same(got, ref, name)
    # every raw input the option reads gets a nonzero gradient
    grads = dict(zip(NAMES, got[1]))
    kw, use_dt = split(OPTIONS[name])
    gate = kw.get("use_gate_in_kernel", False)
    used = ["g_raw", "A_log"] * gate + ["dt_bias"] * (gate and use_dt)
    used += ["beta_raw"] * kw.get("use_beta_sigmoid_in_kernel", False)
    for n in used:
        assert np.all(np.isfinite(grads[n])) and np.any(grads[n]), n


AX = "cp"


def test_gdn_kcp_options_equal_reference_gates(rng):
    W, T, layout = 4, 256, "zigzag"
    cu = np.array([0, 1, 90, 90, 200, T], np.int32)
    args = raw_inputs(rng, T, H=2, K=16, V=16)
    do = jnp.asarray(rng.standard_normal((1, T, 4, 16)), jnp.float32)
    m = cpu_mesh((W,), (AX,))
    tok, rep = NamedSharding(m, P(None, AX)), NamedSharding(m, P())
    cu_j = jnp.asarray(cu)
    lay = lambda x: jax.device_put(J.to_layout(x, cu_j, layout, W), tok)
    opts = OPTIONS["all"]

    def local(q, k, v, g, b, A_log, dt_bias, cu, do):
        op = functools.partial(J.gdn_kcp, cu_seqlens=cu, axis_name=AX, layout=layout,
                               exchange="a2a", segments=2, backend="xla")
        out = []
        for f in (with_options(op, opts), with_reference(op, opts)):
            o, pull = jax.vjp(f, q, k, v, g, b, A_log, dt_bias)
            out.append((o, pull(do)))
        return out

    spec = (P(None, AX), (P(None, AX),) * 5 + (P(), P()))
    fn = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(None, AX),) * 5 + (P(),) * 3 + (
        P(None, AX),), out_specs=[spec, spec]))
    q, k, v, g, b, A_log, dt_bias = args
    (got, ref) = fn(*[lay(x) for x in (q, k, v, g, b)], jax.device_put(A_log, rep),
                    jax.device_put(dt_bias, rep), jax.device_put(cu_j, rep), lay(do))
    back = lambda x: np.asarray(J.from_layout(x, cu_j, layout, W) if x.ndim >= 3 else x)
    glob = lambda r: (back(r[0]), [back(x) for x in r[1]])
    assert_same(glob(got), glob(ref), "kcp")
    # and equals gdn on one device with the same options (A_log, dt_bias: summed over ranks)
    one = with_options(functools.partial(J.gdn, cu_seqlens=cu_j, backend="xla"), opts)
    o1, g1 = jax.jit(lambda *a: (lambda o, pull: (o, pull(do)))(*jax.vjp(one, *a)))(*args)
    o, grads = glob(got)
    assert rel_rms(o, o1) <= 1e-5
    for n, a, r in zip(NAMES, grads, g1):
        assert rel_rms(a, r) <= 1e-5, n


@pytest.mark.parametrize("name", list(OPTIONS))
def test_saved_layout_counts_gate_residuals(rng, name):
    T = 150
    cu = jnp.asarray(uneven_cu_seqlens(rng, T))
    q, k, v, g, b, A_log, dt_bias = raw_inputs(rng, T, H=2, K=16, V=16, dtype=jnp.bfloat16)
    kw, use_dt = split(OPTIONS[name])
    if kw.get("use_gate_in_kernel"):
        kw.update(A_log=A_log, dt_bias=dt_bias if use_dt else None)
    kw.update(cu_seqlens=cu, backend="xla")
    pullback = jax.eval_shape(lambda *a: jax.vjp(lambda *a: J.gdn(*a, **kw), *a)[1], q, k, v, g, b)
    kept = sorted((tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(pullback))
    layout = J.saved_layout(q, k, v, g, b, **kw)
    assert sorted((s, str(d)) for s, d, _ in layout.values()) == kept
    gate = {"g_raw", "A_log"} | ({"dt_bias"} if use_dt else set()) if "A_log" in kw else set()
    gate |= {"beta_raw"} if kw.get("use_beta_sigmoid_in_kernel") else set()
    base = J.saved_layout(q, k, v, g, b, cu_seqlens=cu, backend="xla")
    assert set(layout) - set(base) == gate
    # per rank under gdn_kcp: the same raw inputs, a T/W slice of them
    W = 2
    lay = J.saved_layout(q, k, v, g, b, num_ranks=W, cu_seqlens=cu, **{
        n: x for n, x in kw.items() if n not in ("cu_seqlens",)})
    base = J.saved_layout(q, k, v, g, b, num_ranks=W, cu_seqlens=cu, backend="xla")
    extra = {n: lay[n][0] for n in set(lay) - set(base)}
    want = {"g_raw": (1, T // W, 4), "A_log": (4,), "dt_bias": (4,), "beta_raw": (1, T // W, 4)}
    assert extra == {f"gdn_{n}": want[n] for n in gate}


def _bad(args, **kw):
    q, k, v, g, b, A_log, dt_bias = args
    return J.gdn(q, k, v, g, b, backend="xla", **kw)


@pytest.mark.parametrize("kw,exc,text", [
    (dict(use_gate_in_kernel=True), ValueError, "A_log must be given"),
    (dict(A_log="A"), ValueError, "A_log is only used with use_gate_in_kernel"),
    (dict(dt_bias="dt"), ValueError, "dt_bias is only used with use_gate_in_kernel"),
    (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval=True requires"),
    (dict(use_gate_in_kernel=True, A_log="A[:2]"), ValueError, r"A_log must have shape \[HV\]"),
    (dict(use_gate_in_kernel=True, A_log="A", dt_bias="dt[None]"), ValueError,
     r"dt_bias must have shape \[HV\]"),
    (dict(use_gate_in_kernel=True, A_log="A.astype(jnp.bfloat16)"), TypeError,
     "A_log must be float32"),
    (dict(use_gate_in_kernel=True, A_log="A", dt_bias="dt.astype(jnp.float16)"), TypeError,
     "dt_bias must be float32"),
    (dict(use_gate_in_kernel=True, A_log="A.tolist()"), TypeError, "A_log must be an array"),
])
def test_bad_gate_options(rng, kw, exc, text):
    args = raw_inputs(rng, 64, H=2, K=16, V=16)
    env = dict(A=args[5], dt=args[6], jnp=jnp)
    kw = {n: (eval(x, env) if isinstance(x, str) else x) for n, x in kw.items()}
    with pytest.raises(exc, match=text):
        _bad(args, **kw)
    if exc is ValueError and "only used" not in text:  # gdn_kcp runs the same checks
        q, k, v, g, b, *_ = args
        m = cpu_mesh((1,), (AX,))
        f = jax.jit(jax.shard_map(lambda *a: J.gdn_kcp(*a, cu_seqlens=jnp.array([0, 64], jnp.int32),
                                               axis_name=AX, backend="xla", **kw),
                          mesh=m, in_specs=P(), out_specs=P(), check_vma=False))
        with pytest.raises(exc, match=text):
            f(q, k, v, g, b)
