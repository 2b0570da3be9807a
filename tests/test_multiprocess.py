"""gdn_kcp over two processes (jax.distributed on localhost, 4 CPU devices each, gloo collectives)
equals gdn in one process: o and every input gradient."""

import os
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[3])
    from conftest import make_inputs, rel_rms  # (sets 8 host devices: overridden below)
    from kcp_harness import AX, docs_for, run_one_device
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{sys.argv[2]}",
                               num_processes=2, process_id=int(sys.argv[1]))
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_cake_gdn as J

    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
    W, T = 8, 512
    rng = np.random.default_rng(7)  # the same global inputs in both processes
    mesh = jax.make_mesh((W,), (AX,))
    tok = NamedSharding(mesh, P(None, AX))
    args = make_inputs(rng, T=T, H=1, HV=2, K=16, V=16)[:5]
    do = rng.standard_normal((1, T, 2, 16)).astype(np.float32)
    for layout, exchange in (("doc_zigzag", "a2a"), ("zigzag", "ring")):
        cu = docs_for(layout, W, T, rng)
        lay = lambda x: np.asarray(J.to_layout(np.asarray(x), jnp.asarray(cu), layout, W))
        put = lambda x: jax.make_array_from_callback(x.shape, tok, lambda i, x=lay(x): x[i])
        back = lambda x: np.asarray(J.from_layout(
            multihost_utils.process_allgather(x, tiled=True), jnp.asarray(cu), layout, W))

        def local(q, k, v, g, beta, cu, do):
            f = lambda *a: J.gdn_kcp(*a, cu_seqlens=cu, axis_name=AX, layout=layout,
                                     exchange=exchange, backend="xla")
            o, pull = jax.vjp(f, q, k, v, g, beta)
            return o, pull(do)

        fn = jax.jit(jax.shard_map(local, mesh=mesh,
                                   in_specs=(P(None, AX),) * 5 + (P(), P(None, AX)),
                                   out_specs=(P(None, AX), (P(None, AX),) * 5)))
        cu_g = jax.make_array_from_callback(cu.shape, NamedSharding(mesh, P()), lambda i: cu[i])
        o, grads = fn(*[put(x) for x in args], cu_g, put(do))
        ro, rgrads = run_one_device(jax.local_devices()[0], cu, args, do)
        errs = [rel_rms(back(a), b) for a, b in zip([o, *grads], [ro, *rgrads])]
        assert max(errs) <= 1e-5, (layout, exchange, errs)
    print("OK", jax.process_index())
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one():
    port = _free_port()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"  # host devices also on a GPU host
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port), tests], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {i}" in out, f"process {i}:\n{out[-6000:]}"
