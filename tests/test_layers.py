"""The Flax NNX GatedDeltaNet layer: structure and every option vs the f64 oracle, CP (W = 4)
equals one device in output and parameter gradients, a few SGD steps learn, prefill + decode
with the cache equals one pass, attention masks drop tokens, sharding annotations place the
parameters on a mesh, bad arguments raise."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh, rel_rms, uneven_cu_seqlens
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_cake_gdn as J  # noqa: E402
from jax_cake_gdn.layers import GatedDeltaNet, GDNCache  # noqa: E402
from jax_cake_gdn.reference import gdn_reference, short_conv_reference  # noqa: E402

AX = "cp"
D = 32


def make_layer(seed, dtype=jnp.float32, **kw):
    kw = dict(num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, dtype=dtype,
              backend="xla") | kw
    return GatedDeltaNet(D, **kw, rngs=nnx.Rngs(seed))


def test_init_and_structure_vs_reference(rng):
    layer = make_layer(int(rng.integers(1 << 30)), num_heads=2, num_v_heads=4)
    A = np.exp(np.asarray(layer.A_log[...]))
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert ((A >= 1) & (A <= 16)).all() and ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
    np.testing.assert_array_equal(np.asarray(layer.o_norm.weight[...]), 1.0)
    assert layer.conv_weight.shape == (2 * 2 * 16 + 4 * 16, 4)

    T = 150
    cu = uneven_cu_seqlens(rng, T)
    x = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    call = nnx.jit(lambda m, x, cu: m(x, cu_seqlens=cu))
    y = call(layer, x, jnp.asarray(cu))
    q, k, v, g, beta = nnx.jit(lambda m, x, cu: m.gdn_inputs(x, cu))(layer, x, jnp.asarray(cu))
    assert q.shape == (1, T, 2, 16) and v.shape == (1, T, 4, 16) and g.dtype == jnp.float32
    assert (np.asarray(g) <= 0).all() and ((np.asarray(beta) > 0) & (np.asarray(beta) < 1)).all()
    # the layer's output rebuilt from the f64 oracle on exactly what gdn sees
    o, _ = gdn_reference(q, k, v, g, beta, cu_seqlens=cu, qk_l2norm=True)
    o = jnp.asarray(o, jnp.float32)
    gate = layer.g_proj(x).reshape(1, T, 4, 16)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + 1e-6) * jax.nn.silu(gate)
    assert rel_rms(y, layer.o_proj(o.reshape(1, T, 64))) <= 1e-5
    yb = call(make_layer(0, dtype=jnp.bfloat16), x, jnp.asarray(cu))
    assert yb.dtype == jnp.bfloat16 and np.isfinite(np.asarray(yb, np.float32)).all()


@functools.lru_cache(maxsize=None)
def mesh(W):
    return cpu_mesh((W,), (AX,))


def loss_and_grads(graphdef, params, x, cu, dy, cp=None):
    def f(params, x, dy):
        layer = nnx.merge(graphdef, params)
        y = layer(x, cu_seqlens=cu, **(cp or {}))
        s = jnp.sum(y * dy)
        return (jax.lax.psum(s, AX) if cp else s), y

    (_, y), grads = jax.value_and_grad(f, has_aux=True)(params, x, dy)
    return y, grads


@pytest.mark.parametrize("layout", ("contiguous", "zigzag"))
def test_cp_matches_one_device(rng, layout):
    W, T = 4, 256
    layer = make_layer(int(rng.integers(1 << 30)))
    graphdef, params = nnx.split(layer)
    cu = uneven_cu_seqlens(rng, T, n_docs=5)
    cu_j = jnp.asarray(cu)
    x = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    y1, g1 = jax.jit(lambda p, x, cu, dy: loss_and_grads(graphdef, p, x, cu, dy))(
        params, x, cu_j, dy)

    m = mesh(W)
    tok, rep = NamedSharding(m, P(None, AX)), NamedSharding(m, P())
    lay = lambda a: jax.device_put(J.to_layout(a, cu_j, layout, W), tok)
    body = lambda p, x, cu, dy: loss_and_grads(graphdef, p, x, cu, dy,
                                               dict(axis_name=AX, layout=layout))
    fn = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P(), P(None, AX), P(), P(None, AX)),
                               out_specs=(P(None, AX), P())))
    yw, gw = fn(jax.device_put(params, rep), lay(x), jax.device_put(cu_j, rep), lay(dy))
    assert rel_rms(J.from_layout(yw, cu_j, layout, W), y1) <= 1e-5
    flat1, flatw = jax.tree.leaves_with_path(g1), jax.tree.leaves(gw)
    assert len(flat1) == len(flatw) == 11
    errs = {jax.tree_util.keystr(p): rel_rms(b, a) for (p, a), b in zip(flat1, flatw)}
    # A_log and dt_bias ([HV]) get sums over all tokens of terms that cancel ~10x: the ~1e-6
    # float32 noise of the per-token gate gradient shows there as up to ~1e-5 (seen 9.6e-6)
    tol = lambda name: 5e-5 if ("A_log" in name or "dt_bias" in name) else 1e-5
    assert all(e <= tol(n) for n, e in errs.items()), errs


def test_sgd_steps_reduce_loss(rng):
    T, steps, lr = 128, 8, 0.5
    layer = make_layer(int(rng.integers(1 << 30)))
    graphdef, params = nnx.split(layer)
    cu = jnp.asarray([0, 40, 41, 128], jnp.int32)
    x = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    # a fixed regression target: a random linear map of the previous token (needs the mixer)
    M = jnp.asarray(rng.standard_normal((D, D)) * D**-0.5, jnp.float32)
    target = jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0))) @ M

    @jax.jit
    def step(params):
        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, p)(x, cu_seqlens=cu) - target) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, b: a - lr * b, params, grads), loss

    losses = []
    for _ in range(steps):
        params, loss = step(params)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("kw,match", [
    (dict(num_heads=2, num_v_heads=3), "num_v_heads"),
    (dict(head_k_dim=0), "head_k_dim"),
    (dict(conv_size=5), "conv_size"),
    (dict(layout="diagonal"), "layout"),
    (dict(dtype=jnp.float16), "dtype"),
    (dict(backend="tpu"), "backend"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(head_k_dim=None, head_v_dim=None, head_dim=16, expand_v=0.3), "expand_v"),
    (dict(head_dim=8), "head_dim"),
    (dict(expand_v=2), "expand_v"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        make_layer(0, **kw)


def test_bad_call_arguments(rng):
    layer = make_layer(0)
    with pytest.raises(ValueError, match="hidden_size"):
        layer(jnp.zeros((1, 8, D + 1), jnp.float32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(jnp.zeros((1, 8, D), jnp.float32), axis_name=AX)
    x, cu = jnp.zeros((2, 8, D), jnp.float32), jnp.asarray([0, 8], jnp.int32)
    mask = jnp.ones((2, 8), jnp.int32)
    cases = [
        (ValueError, "attention_mask", dict(attention_mask=jnp.ones((2, 7), bool))),
        (TypeError, "attention_mask", dict(attention_mask=jnp.ones((2, 8), jnp.float32))),
        (TypeError, "cache", dict(cache=(jnp.zeros((2, 3, 96)), jnp.zeros((2, 2, 16, 16))))),
        (ValueError, "cache.conv", dict(cache=GDNCache(jnp.zeros((2, 2, 96)),
                                                       jnp.zeros((2, 2, 16, 16))))),
        (ValueError, "cache.state", dict(cache=GDNCache(layer.init_cache(2).conv,
                                                        jnp.zeros((2, 2, 16, 8))))),
        (TypeError, "cache.state", dict(cache=layer.init_cache(2)._replace(
            state=jnp.zeros((2, 2, 16, 16), jnp.bfloat16)))),
        (ValueError, "initial_state", dict(cache=layer.init_cache(2),
                                           initial_state=jnp.zeros((2, 2, 16, 16)))),
        (ValueError, "mode", dict(mode="fused")),
    ]
    for err, match, kw in cases:
        with pytest.raises(err, match=match):
            layer(x, **kw)
    x1 = x[:1]
    for err, match, kw in [(ValueError, "attention_mask", dict(attention_mask=mask[:1])),
                           (ValueError, "cache", dict(cache=layer.init_cache(1))),
                           (ValueError, "recurrent", dict(mode="recurrent"))]:
        with pytest.raises(err, match=match):
            layer(x1, cu_seqlens=cu, **kw)
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x1, cu_seqlens=cu, axis_name=AX, attention_mask=mask[:1])


def numpy_layer(layer, x, cu_seqlens=None, initial_state=None):
    """The layer's forward from its parameters in float64 numpy and the oracles (not from its
    own methods): projections, conv (+ bias) and SiLU, gates, gdn_reference, norm, o_proj."""
    P = lambda v: np.asarray(v[...], np.float64)
    silu = lambda t: t / (1 + np.exp(-t))
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    qkv = np.concatenate([x @ P(m.kernel) for m in (layer.q_proj, layer.k_proj, layer.v_proj)],
                         -1)
    if layer.use_short_conv:
        qkv = short_conv_reference(qkv, P(layer.conv_weight), cu_seqlens=cu_seqlens,
                                   activation=None)
        if layer.conv_bias is not None:
            qkv = qkv + P(layer.conv_bias)
    qkv = silu(qkv)
    q, k, v = np.split(qkv, [H * K, 2 * H * K], -1)
    g = -np.exp(P(layer.A_log)) * np.logaddexp(0, x @ P(layer.a_proj.kernel) + P(layer.dt_bias))
    beta = 1 / (1 + np.exp(-(x @ P(layer.b_proj.kernel))))
    o, final = gdn_reference(q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V),
                             g, beta, cu_seqlens=cu_seqlens, qk_l2norm=layer.qk_l2norm,
                             initial_state=initial_state)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + layer.o_norm.eps) * P(layer.o_norm.weight)
    if layer.use_gate:
        o = o * silu((x @ P(layer.g_proj.kernel)).reshape(B, T, HV, V))
    return o.reshape(B, T, HV * V) @ P(layer.o_proj.kernel), final


@pytest.mark.parametrize("use_gate,use_short_conv,conv_bias,qk_l2norm,heads,state", [
    (True, True, False, True, (2, 4), False),
    (False, True, True, True, (2, 2), True),
    (True, False, False, False, (1, 3), True),
    (False, False, False, True, (2, 4), False),
])
def test_options_vs_reference(rng, use_gate, use_short_conv, conv_bias, qk_l2norm, heads, state):
    layer = make_layer(int(rng.integers(1 << 30)), num_heads=heads[0], num_v_heads=heads[1],
                       use_gate=use_gate, use_short_conv=use_short_conv, conv_bias=conv_bias,
                       qk_l2norm=qk_l2norm, head_v_dim=8)
    assert (layer.g_proj is None) != use_gate and (layer.conv_weight is None) != use_short_conv
    assert (layer.conv_bias is not None) == (conv_bias and use_short_conv)
    T = 130
    cu = uneven_cu_seqlens(rng, T)
    x = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((4, heads[1], 16, 8)) * 0.3, jnp.float32) \
        if state else None
    y = nnx.jit(lambda m, x, cu, h0: m(x, cu_seqlens=cu, initial_state=h0))(
        layer, x, jnp.asarray(cu), h0)
    assert rel_rms(y, numpy_layer(layer, x, cu, h0)[0]) <= 1e-5


def test_head_dims_from_fla_names():
    layer = nnx.eval_shape(lambda: GatedDeltaNet(64, num_heads=2, rngs=nnx.Rngs(0)))
    assert (layer.head_k_dim, layer.head_v_dim) == (256, 512)  # FLA's defaults
    layer = make_layer(0, head_k_dim=None, head_v_dim=None, head_dim=16, expand_v=1.5)
    assert (layer.head_k_dim, layer.head_v_dim) == (16, 24)
    assert layer.v_proj.kernel.shape == (D, 2 * 24)


def test_prefill_then_decode_equals_one_pass(rng, heads=(1, 2)):
    """Prompt through the chunked gdn into a cache, then token by token with gdn_step: the
    outputs and the final state equal one pass over the whole sequence (GVA; without GVA the
    step is checked in test_recurrent)."""
    B, T, P_ = 2, 90, 67
    layer = make_layer(int(rng.integers(1 << 30)), num_heads=heads[0], num_v_heads=heads[1],
                       conv_bias=True)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    prefill = nnx.jit(lambda m, x, c: m(x, cache=c, mode="chunk"))
    decode = nnx.jit(lambda m, x, c: m(x, cache=c))  # mode None: recurrent for T <= 64
    y, cache = prefill(layer, x[:, :P_], layer.init_cache(B))
    ys = [y]
    for t in range(P_, T - 3):
        y, cache = decode(layer, x[:, t:t + 1], cache)
        ys.append(y)
    y, cache = decode(layer, x[:, T - 3:], cache)  # a few tokens at once
    ys.append(y)
    assert rel_rms(jnp.concatenate(ys, axis=1), full) <= 1e-5
    assert rel_rms(cache.state, numpy_layer(layer, x)[1]) <= 1e-5
    assert cache.conv.shape == (B, 3, layer.conv_weight.shape[0])
    qkv = jnp.concatenate([m(x[:, -3:]) for m in (layer.q_proj, layer.k_proj, layer.v_proj)], -1)
    np.testing.assert_allclose(cache.conv, qkv, rtol=1e-6)  # the conv's last 3 input rows


def test_attention_mask_drops_tokens(rng):
    B, T = 4, 40
    layer = make_layer(int(rng.integers(1 << 30)), num_heads=2, num_v_heads=4)
    mask = np.ones((B, T), bool)
    mask[0, :7] = False  # left padding
    mask[1, 29:] = False  # right padding
    mask[2, rng.choice(T, 9, replace=False)] = False  # holes
    mask[3, :] = False  # nothing
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    call = nnx.jit(lambda m, x, mask, c: m(x, attention_mask=mask, cache=c))
    y, cache = call(layer, jnp.asarray(x), jnp.asarray(mask), layer.init_cache(B))
    x2 = np.where(mask[..., None], x, rng.standard_normal(x.shape) * 100).astype(np.float32)
    y2, cache2 = call(layer, jnp.asarray(x2), jnp.asarray(mask), layer.init_cache(B))
    np.testing.assert_array_equal(y, y2)  # masked tokens change nothing
    np.testing.assert_array_equal(cache.state, cache2.state)
    assert not np.asarray(y)[~mask].any()
    nxt = rng.standard_normal((B, 1, D)).astype(np.float32)
    y_next, c_next = nnx.jit(lambda m, x, c: m(x, cache=c))(layer, jnp.asarray(nxt), cache)
    for b in range(3):  # each row = its kept tokens alone, then the next token
        ref, state = numpy_layer(layer, np.concatenate([x[b, mask[b]], nxt[b]])[None])
        assert rel_rms(np.asarray(y)[b, mask[b]], ref[0, :-1]) <= 1e-5
        assert rel_rms(y_next[b], ref[0, -1:]) <= 1e-5
        assert rel_rms(c_next.state[b], state[0]) <= 1e-5
    np.testing.assert_array_equal(cache.state[3], 0)  # an empty row keeps its (zero) state


def test_sharding_annotations(rng):
    """Logical axes on every parameter; with rules under a mesh the layer is created sharded
    (FSDP over the model width, TP over heads) and computes what the unsharded one does."""
    rules = (("embed", "fsdp"), ("heads", "tp"))
    kw = dict(num_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=8, conv_bias=True)
    plain = make_layer(3, **kw)
    specs = nnx.to_flat_state(nnx.get_partition_spec(nnx.state(plain, nnx.Param)))
    want = {("q_proj", "kernel"): P("embed", "heads"), ("a_proj", "kernel"): P("embed", "heads"),
            ("o_proj", "kernel"): P("heads", "embed"), ("conv_weight",): P("heads", None),
            ("conv_bias",): P("heads"), ("A_log",): P("heads"), ("o_norm", "weight"): P(None)}
    got = {path: v.get_value() for path, v in specs}
    assert len(got) == 12 and all(got[p] == s for p, s in want.items()), got
    m = cpu_mesh((2, 4), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jnp.asarray(rng.standard_normal((2, 50, D)), jnp.float32)
    with jax.set_mesh(m):
        layer = make_layer(3, **kw, sharding_rules=rules)
        y = nnx.jit(lambda m, x: m(x))(layer, x)
    for path, spec in want.items():
        arr = functools.reduce(getattr, path, layer)[...]
        mesh_spec = NamedSharding(m, P(*(dict(rules).get(a, a) for a in spec)))
        assert arr.sharding.is_equivalent_to(mesh_spec, arr.ndim), (path, arr.sharding)
    assert rel_rms(y, nnx.jit(lambda m, x: m(x))(plain, x)) <= 1e-5


def test_demo_generate(capsys):
    from jax_cake_gdn import demo

    rc = demo.main(["--generate", "--tokens", "70", "--batch", "2", "--new-tokens", "3",
                    "--heads", "1,2", "--head-dim", "16", "--d-model", "32", "--dtype", "f32",
                    "--backend", "xla"])
    out = capsys.readouterr().out
    assert rc == 0 and "OK" in out and "decode:" in out, out
