"""Smoke tests of the benchmark runner, its tools and the demo on CPU. Never asserts timings."""

import json
import os
import re

import pytest

from benchmarks import arms, frameworks, run, traces, workloads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_floor_matches_design():
    # the design's FLOP floors: 0.35 / 1.35 ms (B23), 0.70 / 2.7 (long), 0.09 / 0.34 (small heads)
    for name, fwd, fb in (("B23", 0.35, 1.35), ("long", 0.70, 2.7), ("small_heads", 0.09, 0.34)):
        w = workloads.get(name)
        assert w.floor("fwd")["ms"] == pytest.approx(fwd, rel=0.05)
        assert w.floor("fwd+bwd")["ms"] == pytest.approx(fb, rel=0.05)
    assert workloads.get("small_heads").T == 65536
    assert workloads.get("B23").T == 32768


def test_inputs_are_valid():
    w = workloads.get("tiny")
    x = w.make_inputs(0)
    assert x["q"].shape == (1, w.T, w.H, w.K) and x["v"].shape == (1, w.T, w.HV, w.V)
    assert (x["g"] <= 0).all() and ((x["beta"] > 0) & (x["beta"] < 1)).all()
    assert x["q"].std() > 0.5 and list(x["cu_seqlens"]) == [0, 150, 247, 300]
    xl = workloads.get("tiny-layer").make_inputs(0)
    assert xl["x"].shape == (1, w.T, w.conv_channels) and xl["conv_w"].shape == (w.conv_channels, 4)


def test_custom_shapes():
    b23 = workloads.get("B23")
    w = workloads.custom(b23, tokens=4099, docs="3", heads="2,6", head_dim="64")
    assert w.doc_lens == (1367, 1366, 1366) and (w.H, w.HV, w.K, w.V) == (2, 6, 64, 64)
    assert w.name == "T4099-N3-H2x6-K64V64" and not w.layer
    w = workloads.custom(b23, tokens=1000)  # the base's document count, split evenly
    assert w.doc_lens == (250,) * 4 and (w.H, w.HV, w.K, w.V) == (16, 48, 128, 128)
    w = workloads.custom(workloads.get("tiny-layer"), docs="40,60", heads="1", head_dim="16,32")
    assert w.doc_lens == (40, 60) and (w.H, w.HV, w.K, w.V) == (1, 1, 16, 32) and w.layer
    assert w.name.endswith("-layer") and w.make_inputs(0)["x"].shape == (1, 100, 16 + 16 + 32)
    for kw, msg in ((dict(heads="3,4"), "multiple"), (dict(docs="5,0"), "positive"),
                    (dict(tokens=10, docs="4,5"), "sum to 9"), (dict(head_dim="1,2,3"), "two"),
                    (dict(tokens=2, docs="3"), "docs <= tokens")):
        with pytest.raises(ValueError, match=msg):
            workloads.custom(b23, **kw)
    a = run.parse_args(["--workload", "tiny", "--tokens", "64", "--docs", "2"])
    assert a.wl.doc_lens == (32, 32) and a.wl.K == 32
    with pytest.raises(SystemExit):
        run.parse_args(["--heads", "3,4"])
    # TFLOP/s from the floor model's FLOPs
    assert b23.tflops("fwd", 1.0) == pytest.approx(b23.flops("fwd") / 1e-3 / 1e12)


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = capsys.readouterr().out
    opts = re.findall(r"^  (--[a-z-]+)", text, re.M)
    assert {"--tokens", "--docs", "--heads", "--head-dim", "--device-calls", "--out"} <= set(opts)
    blocks = re.split(r"\n  (?=--)", text.split("options:", 1)[1])
    for block in blocks:
        if block.startswith("--"):
            assert "(default:" in block, block
    assert "(default: 5)" in text and "(default: 12)" in text


def test_results_go_outside_the_repo(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    out = os.path.realpath(run.default_out_dir())
    assert not out.startswith(os.path.realpath(REPO) + os.sep), out
    assert run.parse_args([]).out == run.default_out_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert run.default_out_dir() == str(tmp_path / "jax-cake-gdn" / "bench")
    from benchmarks import plot

    monkeypatch.setattr(plot, "plot", lambda runs, out: runs.append(out))
    runs = plot.main([])  # the repository's result files; the PNG path is outside the repo
    assert runs[-1] == str(tmp_path / "jax-cake-gdn" / "bench" / "gdn.png")


def test_spread_is_flagged_above_five_percent():
    s = run.summarize([[1.0, 1.2], [1.04, 1.06], [0.98, 1.0]])
    assert s["group_medians_ms"] == pytest.approx([1.1, 1.05, 0.99])
    assert s["median_ms"] == pytest.approx(1.05)  # the median of the group medians
    assert s["spread"] == pytest.approx(0.11 / 1.05) and s["spread_flag"]
    assert not run.summarize([[1.0], [1.04], [1.02]])["spread_flag"]


@pytest.mark.parametrize("name,ops,arm_list,extra", [
    ("tiny", ["fwd", "ckpt"], ["xla", "cuda", "fla"], []),
    ("tiny-layer", ["fwd+bwd"], ["xla", "xla:full"],
     ["--docs", "40,60", "--heads", "1,2", "--head-dim", "16,32"])])
def test_runner_end_to_end(tmp_path, monkeypatch, capsys, name, ops, arm_list, extra):
    # cuda: runs on a GPU build, else is skipped with the reason; fla (torch) is skipped here.
    # The custom-shaped run writes to the default folder (under $XDG_CACHE_HOME).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = [] if extra else ["--out", str(tmp_path)]
    res = run.main(["--workload", name, "--ops", ",".join(ops), "--arms", ",".join(arm_list),
                    "--groups", "1", "--calls", "2", "--warmup", "1", "--device-calls", "2",
                    "--tag", "smoke", *out, *extra])
    wl = res["workload"]
    if extra:
        assert wl["name"] == "T100-N2-H1x2-K16V32-layer" and wl["doc_lens"] == [40, 60]
        assert (wl["H"], wl["HV"], wl["K"], wl["V"], wl["layer"]) == (1, 2, 16, 32, True)
    path = (tmp_path / "jax-cake-gdn" / "bench" if extra else tmp_path) / f"{wl['name']}_smoke.json"
    assert res["path"] == str(path)
    data = json.loads(path.read_text())
    for key in ("schema", "workload", "device", "versions", "config", "floor", "results",
                "skipped"):
        assert key in data
    assert data["complete"] and data["versions"]["jax"] and data["device"]["platform"] == "cpu"
    got = {(r["arm"], r["op"]) for r in data["results"]}
    skipped = {(s["arm"], s["op"]): s["reason"] for s in data["skipped"]}
    for op in ops:
        for arm in arm_list:
            assert (arm, op) in got or (arm in ("cuda", "fla") and (arm, op) in skipped)
        if "fla" in arm_list:
            assert "not importable" in skipped["fla", op] or "no CUDA" in skipped["fla", op]
    w = workloads.Workload(**{k: tuple(v) if k == "doc_lens" else v for k, v in wl.items()
                              if k != "T"})
    for r in data["results"]:
        assert len(r["times_ms"]) == 1 and len(r["times_ms"][0]) == 2
        assert r["framework"] == "jax"
        # dispatch is the part of each call before its sync: never more than the call
        assert 0.0 < r["dispatch_median_ms"] <= r["median_ms"]
        assert r["tflops"] == pytest.approx(w.flops(r["op"]) / r["median_ms"] / 1e9)
        assert r["spread"] == 0.0 and r["spread_flag"] is False  # one group
        # no GPU here: no device time, and the reason says so
        assert r["device_ms"] is None and r["wall_minus_device_ms"] is None
        assert "without GPU activity" in r["device_note"] and len(r["device_calls_ms"]) == 2
        if r["arm"] == "xla:full":  # full and light give equal results (bitwise)
            assert r["check"]["max_rel_rms"] == 0.0
    printed = capsys.readouterr()
    assert "TFLOP/s" in printed.out and "device ms" in printed.out
    for op in ops:  # progress: the op, the group and the arms, as they go
        assert re.search(rf"{re.escape(op)}: group 1/1 medians ms \(dispatch\): xla ", printed.err)


def _fake_framework(name, log):
    """A framework that logs what the runner asks of it."""
    def device_times(call, mib, n):
        log.append(("profile", name, mib, n))
        return {"calls_ms": [0.5] * n, "launches": [1] * n, "device_ms": 0.5, "reason": None}

    return frameworks.Framework(name, lambda res: log.append(("sync", name, res)),
                                lambda mib: log.append(("flush", name, mib)), device_times)


def test_each_arm_is_flushed_synced_and_profiled_by_its_own_framework(monkeypatch):
    log = []
    fws = {"fa": _fake_framework("jax", log), "fb": _fake_framework("torch", log)}

    def factory(arm):
        def setup(wl, op, inputs):
            return lambda: log.append(("call", arm)) or arm

        return lambda opts: arms.Arm(name=arm, setup=setup, framework=fws[arm])

    monkeypatch.setitem(arms.FACTORIES, "fa", factory("fa"))
    monkeypatch.setitem(arms.FACTORIES, "fb", factory("fb"))
    res = run.main(["--workload", "tiny", "--ops", "fwd", "--arms", "fb,fa", "--groups", "2",
                    "--calls", "3", "--warmup", "1", "--flush-mib", "7", "--device-calls", "2",
                    "--out", ""])
    calls = [i for i, e in enumerate(log) if e[0] == "call"]
    assert len(calls) == 2 * (1 + 2 * 3)  # warm-up and timed calls of both arms
    for i in calls:
        arm = log[i][1]
        fw = fws[arm].name
        assert log[i - 1] == ("flush", fw, 7), log[i - 1:i + 2]  # its own flush just before
        assert log[i + 1] == ("sync", fw, arm), log[i - 1:i + 2]  # and its own sync after
    timed = [log[i][1] for i in calls[2:]]
    assert timed == ["fb", "fb", "fa", "fa", "fa", "fb"] * 2  # palindromic: A A B B | B A
    # device time after all timing, JAX arms first, each by its own framework
    assert [e for e in log if e[0] == "profile"] == [("profile", "jax", 7, 2),
                                                      ("profile", "torch", 7, 2)]
    for r in res["results"]:
        assert r["device_ms"] == 0.5 and r["framework"] == fws[r["arm"]].name
        assert r["wall_minus_device_ms"] == pytest.approx(r["median_ms"] - 0.5)


def test_arms_take_their_framework():
    import jax

    for spec in ("xla", "cuda:full:det", "base", "kcp:2:xla"):
        a = arms.make_arm(spec)
        assert (a.framework, a.flush, a.sync) == (frameworks.JAX, frameworks.jax_flush,
                                                  frameworks.jax_sync)
    for spec in ("flashqla", "fla"):
        a = arms.make_arm(spec)
        assert (a.framework, a.flush, a.sync) == (frameworks.TORCH, frameworks.torch_flush,
                                                  frameworks.torch_sync)
    frameworks.jax_flush(1)  # a JAX flush writes a JAX buffer on every local device
    frameworks.jax_flush(1)
    bufs = frameworks._JAX_FLUSH[1]
    assert len(bufs) == jax.local_device_count()
    assert {b.devices().pop() for b in bufs} == set(jax.local_devices())
    assert all(isinstance(b, jax.Array) and b.shape == (2**18,) and float(b[0]) == 2.0
               for b in bufs)
    frameworks._JAX_FLUSH.clear()


def test_segments_option_reaches_gdn():
    import types

    import jax

    a = arms.make_arm("cuda:full:P4")
    assert a.options["segments"] == 4 and a.options["save_mode"] == "full"
    assert "segments" not in arms.make_arm("xla").options
    for bad in ("cuda:P0", "xla:Px"):
        with pytest.raises(ValueError, match="unknown option"):
            arms.make_arm(bad)
    seen = {}

    def gdn(q, k, v, g, beta, *, cu_seqlens, segments=None, **kw):
        seen["segments"] = segments
        return v

    w = workloads.get("tiny")
    dev = arms._jax_inputs(w, w.make_inputs(0))
    args = tuple(dev[n] for n in ("q", "k", "v", "g", "beta"))
    fn, _ = arms.build_jax_op(w, "fwd", backend="xla", segments=3,
                              lib=types.SimpleNamespace(__name__="new", gdn=gdn))
    jax.eval_shape(fn, args, dev["do"], dev["cu_seqlens"])
    assert seen["segments"] == 3
    old = types.SimpleNamespace(__name__="old", gdn=lambda q, k, v, g, beta, **kw: v)
    with pytest.raises(arms.ArmUnavailable, match="takes no `segments`"):
        arms.build_jax_op(w, "fwd", backend="xla", segments=3, lib=old)
    arms.build_jax_op(w, "fwd", backend="xla", lib=old)  # without P<n>: not passed at all


def test_torch_layer_conv_is_guarded(monkeypatch):
    # without FLA's causal_conv1d the torch arms' layer is unavailable, saying why
    import sys

    monkeypatch.setitem(sys.modules, "fla", None)  # import fla raises ImportError
    with pytest.raises(arms.ArmUnavailable, match="causal_conv1d: fla.modules.causal_conv1d"):
        arms._fla_conv()


def test_demo_runs(capsys):
    from jax_cake_gdn import demo

    rc = demo.main(["--tokens", "200", "--docs", "3", "--heads", "1,2", "--head-dim", "32",
                    "--d-model", "32", "--steps", "2", "--dtype", "f32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OK" in out and "compiled 1 time" in out and "tokens/s" in out


def test_demo_cp(capsys):
    from jax_cake_gdn import demo

    argv = ["--cp", "2", "--layout", "zigzag", "--tokens", "512", "--docs", "3", "--heads", "1,2",
            "--head-dim", "16", "--d-model", "32", "--steps", "2", "--dtype", "f32"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "context parallel: 2 ranks" in out and "OK" in out and "compiled 1 time" in out


def test_kcp_arms_on_host_devices(tmp_path):
    # gdn_kcp over 2 of the 8 host devices equals gdn (checked against the xla arm; fwd+bwd's
    # outputs hold o too), the exchange-only arm runs, and every JAX row reports its compiled
    # peak bytes.
    specs = ["xla", "kcp:2:zigzag:ring:xla:P2", "kcp:2:xla:xonly"]
    res = run.main(["--workload", "tiny", "--ops", "fwd+bwd", "--arms", ",".join(specs),
                    "--groups", "1", "--calls", "2", "--warmup", "1", "--device-calls", "0",
                    "--out", str(tmp_path), "--tag", "kcp"])
    got = {r["arm"]: r for r in res["results"]}
    assert not res["skipped"], res["skipped"]
    for arm in specs:
        assert got[arm]["peak_bytes"] > 0
    assert got[specs[1]]["check"]["max_rel_rms"] <= 1e-2  # bf16 outputs
    assert "check" not in got[specs[2]]


def test_kernel_times_end_to_end(tmp_path):
    """benchmarks.profiling.kernels: the rows name each primitive of one fwd + bwd once, the
    whole-op rows last; --only times some of them (xla backend here) and writes the JSON."""
    from benchmarks.profiling import kernels

    w = workloads.get("tiny")
    rows = [r[0] for r in kernels.primitive_calls(w, "xla") + kernels.whole_op_calls(w, "xla")]
    assert rows[:4] == ["fwd: l2norm_rstd (q or k)", "fwd: gate_cumsum", "fwd light: solve_a",
                        "fwd light: walk_output"]
    assert {"fwd full: walk_output, tapes", "transfer walk: prep", "bwd: walk_bwd",
            "bwd: chunk_bwd", "bwd light: replay"} <= set(rows)
    assert len(set(rows)) == len(rows)
    assert rows[-4:] == ["gdn fwd light", "gdn fwd full", "gdn fwd+bwd light", "gdn fwd+bwd full"]
    res = kernels.main(["--workload", "tiny", "--backend", "xla", "--calls", "1",
                        "--only", "walk_bwd|replay|fwd\\+bwd full", "--out", str(tmp_path)])
    assert list(res["median_ms"]) == ["bwd: walk_bwd", "bwd light: replay", "gdn fwd+bwd full"]
    assert all(t > 0 for t in res["median_ms"].values())
    saved = json.loads((tmp_path / "kernels_tiny_xla.json").read_text())
    assert saved["median_ms"] == res["median_ms"]


def test_baseline_copy_loads_next_to_the_library(tmp_path, monkeypatch):
    # benchmarks/baseline.py's renamed copy (here of the current tree and its built extension, as
    # `python -m benchmarks.baseline REV` makes of a revision): imports as jcg_base beside
    # jax_cake_gdn, lowers for the cuda platform to its own jcg_base_* FFI targets while the
    # library keeps jax_cake_gdn_*; without a copy the `base` arm is unavailable, saying why.
    import os
    import shutil
    import textwrap

    from conftest import need_ext, run_python

    from benchmarks import arms, baseline

    need_ext()
    import jax_cake_gdn
    import jax_cake_gdn._cuda as ext

    pkg = tmp_path / "built" / "jax_cake_gdn"
    shutil.copytree(os.path.dirname(jax_cake_gdn.__file__), pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ext.__file__, pkg)
    dest = tmp_path / "dest"
    out = baseline.rename_copy(str(pkg), str(dest), "abc1234")
    for path in (dest / "jcg_base").rglob("*.py"):  # no name of the library is left
        text = path.read_text().replace(baseline._REGISTER_RENAMED, "")
        assert "jax_cake_gdn" not in text, path
    assert out == str(dest / "jcg_base")
    run_python(textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from benchmarks import baseline
        import jax_cake_gdn as cur
        base, rev = baseline.load({str(dest)!r})
        assert rev == "abc1234" and base.__name__ == "jcg_base", (rev, base.__name__)
        T, H, D = 128, 2, 64
        r = np.random.default_rng(0)
        q = jnp.asarray(r.standard_normal((1, T, H, D)), jnp.bfloat16)
        g = -jnp.abs(jnp.asarray(r.standard_normal((1, T, H)), jnp.float32))
        beta = jnp.full((1, T, H), 0.5, jnp.float32)
        cu = jnp.array([0, 50, T], jnp.int32)
        texts = {{}}
        for name, lib in (("cur", cur), ("base", base)):
            f = lambda q, g, beta, lib=lib: lib.gdn(q, q, q, g, beta, cu_seqlens=cu,
                                                    backend="cuda")
            texts[name] = jax.jit(f).trace(q, g, beta).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "jcg_base_solve_a_walk_output" in texts["base"], texts["base"][-2000:]
        assert "jax_cake_gdn_" not in texts["base"], "base lowered to the library's targets"
        assert "jcg_base_" not in texts["cur"]
        assert "jax_cake_gdn_solve_a_walk_output" in texts["cur"]
        # per-primitive A/B in one process (xla primitives here: they run on any host)
        import os
        from benchmarks.profiling import kernels
        os.environ[baseline.ENV] = {str(dest)!r}
        res = kernels.main(["--workload", "tiny", "--backend", "xla", "--calls", "1", "--base",
                            "--only", "gate_cumsum|chunk_bwd$|gdn fwd light"])
        assert list(res["median_ms"]) == ["fwd: gate_cumsum", "bwd: chunk_bwd", "gdn fwd light"]
        assert res["base_revision"] == "abc1234"
        assert set(res["base_median_ms"]) == set(res["median_ms"]), res
        assert all(t > 0 for t in res["base_median_ms"].values())
        q = res["base_ratio_median_q25_q75"]
        assert set(q) == set(res["median_ms"]) and all(lo <= m <= hi for m, lo, hi in q.values())
        # the copy is of this tree: every primitive gives the same bits
        assert set(res["base_outputs"].values()) == {{"same bits"}}, res["base_outputs"]
        print("OK")
    """))
    monkeypatch.delenv(baseline.ENV, raising=False)
    w = workloads.get("tiny")
    with pytest.raises(arms.ArmUnavailable, match=baseline.ENV):
        arms.make_arm("base:full").setup(w, "fwd", w.make_inputs(0))


def test_compare_outputs_reports_differences():
    import numpy as np
    from benchmarks.profiling.kernels import compare_outputs

    a = (np.ones((3, 4), np.float32), np.arange(5, dtype=np.int32))
    assert compare_outputs(a, tuple(x.copy() for x in a)) == "same bits"
    b = (a[0] * np.float32(1 + 2 ** -20), a[1])
    assert compare_outputs(a, b) == "differs (max rel 9.5e-07)"  # 2^-20 / (1 + 2^-20)
    c = (np.where(np.eye(3, 4) > 0, np.nan, 1).astype(np.float32), a[1])
    assert compare_outputs(c, a) == "differs (max rel inf)"
    assert compare_outputs(a, a[:1]).startswith("differs (2 vs 1")
    # -0.0 and 0.0 compare equal as numbers but not as bits
    assert compare_outputs((np.float32([-0.0]),), (np.float32([0.0]),)) == (
        "differs (max rel 0.0e+00)")


def test_paired_times_alternate_and_give_the_ratio(monkeypatch):
    # a fake clock: current takes 2 ms a call, baseline 3 ms; the rounds alternate which runs
    # first (after one warm-up call of each, twice), the ratio is baseline / current per round
    from benchmarks.profiling import kernels

    clock, order = [0.0], []

    def arm(name, seconds):
        def f():
            order.append(name)
            clock[0] += seconds
            return 0
        return f

    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    cur, base, (med, q25, q75) = kernels._paired_ms(arm("c", 2e-3), (), arm("b", 3e-3), (),
                                                    calls=4)
    assert order == ["c", "b"] * 2 + ["c", "b", "b", "c", "c", "b", "b", "c"]
    assert cur == pytest.approx(2.0) and base == pytest.approx(3.0)
    assert med == pytest.approx(1.5) and q25 == pytest.approx(1.5) and q75 == pytest.approx(1.5)


# A trimmed `ncu --csv --metrics gpu__time_duration.sum` output of a B23 run (H200).
_NCU_CSV = '''==WARNING== Note: Running with unmodified GPU clocks.
==PROF== Connected to process 1366 (/usr/bin/python3.12)
done
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1366","python3.12","127.0.0.1","void jax_cake_gdn::<unnamed>::l2norm_rstd_kernel<__nv_bfloat16>(const T1 *, float *, long, int)","1","14","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","65,568"
"1","1366","python3.12","127.0.0.1","void jax_cake_gdn::<unnamed>::l2norm_rstd_kernel<__nv_bfloat16>(const T1 *, float *, long, int)","1","14","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","65,792"
"2","1366","python3.12","127.0.0.1","void jax_cake_gdn::walk_output_wg_kernel<__nv_bfloat16, __nv_bfloat16, (int)128, (int)128>(const T1 *, float)","1","14","(256, 1, 1)","(192, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","1,347.26"
"3","1366","python3.12","127.0.0.1","loop_select_fusion","1","14","(128, 1, 1)","(393216, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","240,960"
==PROF== Disconnected from process 1366
'''


def test_device_times_parses_ncu_csv(monkeypatch, capsys):
    """benchmarks.profiling.device_times: launches in order with ms (ns, us units, thousands
    separators), short names, per-kernel totals; a clear exit code when ncu is missing. The ncu
    run itself needs a GPU (not run here)."""
    from benchmarks.profiling import device_times as dt

    rows = dt.parse_ncu_csv(_NCU_CSV)
    assert [round(ms, 6) for _, ms in rows] == [0.065568, 0.065792, 1.34726, 0.24096]
    names = [dt.short_name(n) for n, _ in rows]
    assert names == ["l2norm_rstd_kernel<bf16>", "l2norm_rstd_kernel<bf16>",
                     "walk_output_wg_kernel<bf16, bf16, 128, 128>", "loop_select_fusion"]
    s = dt.summarize(rows)
    assert list(s) == names[1:]  # first-launch order, repeated names merged
    assert s["l2norm_rstd_kernel<bf16>"]["calls"] == 2
    assert s["l2norm_rstd_kernel<bf16>"]["ms"] == pytest.approx(0.13136)
    assert dt.parse_ncu_csv("no csv here\n") == []
    monkeypatch.setattr(dt, "find_ncu", lambda: None)
    assert dt.main(["--workload", "tiny"]) == 2
    assert "ncu not found" in capsys.readouterr().err


def test_device_times_child_runs_the_op():
    """The child (what ncu profiles) runs one op on host-rounded inputs; on CPU with xla."""
    from benchmarks.profiling import device_times as dt

    assert dt.main([dt._CHILD, "--workload", "tiny", "--ops", "fwd+bwd", "--modes", "light",
                    "--backend", "xla"]) == 0


def test_host_time_runs():
    from benchmarks.profiling import host_time

    rows = host_time.main(["--workload", "tiny", "--arms", "xla,xla:full", "--calls", "2",
                           "--flush-mib", "0"])
    assert [r["arm"] for r in rows] == ["xla", "xla:full"]
    for r in rows:
        assert 0 < r["dispatch_ms"] <= r["call_ms"]  # each call returns before its sync ends
        assert r["call_min_ms"] <= r["call_ms"] and r["back_to_back_ms"] > 0


def test_breakdown_timeline_rows_show_gaps_and_overlaps():
    """breakdown --timeline: events in start order, times from the first start, the idle gap
    since the latest end before each (negative: overlap), template arguments cut."""
    from benchmarks.profiling.breakdown import timeline_rows

    ev = [(1010.0, 5.0, "b"), (1000.0, 20.0, "void ns::k<int, 3>(float*)"), (1030.0, 2.0, "c")]
    rows = [r.split() for r in timeline_rows(ev)]
    assert rows == [["0.0", "20.0", "20.0", "0.0", "void", "ns::k"],
                    ["10.0", "15.0", "5.0", "-10.0", "b"],  # starts inside k
                    ["30.0", "32.0", "2.0", "10.0", "c"]]  # 10 us after k's end
    assert timeline_rows([]) == []


def test_breakdown_runs_with_its_timeline(capsys):
    """breakdown on CPU (xla: no device events): the tables and the timeline header print."""
    from benchmarks.profiling import breakdown

    rows = breakdown.main(["--workload", "tiny", "--ops", "fwd", "--segments", "1", "--calls",
                           "1", "--backend", "xla", "--timeline"])
    assert [(r[0], r[1]) for r in rows] == [("fwd", 1)]
    out = capsys.readouterr()
    assert "last call (us)" in out.out
    # progress on stderr before each (op, P) compiles and before its profiled calls
    assert "tiny fwd P=1: compiling" in out.err and "tiny fwd P=1: 1 profiled calls" in out.err


def test_device_time_per_call_from_traces(tmp_path):
    """benchmarks.traces: a jax.profiler trace (folder, .json.gz) and a torch chrome trace
    (.json); each call's device time is the GPU activity that starts inside its host range
    (the flush before it is outside), the stream threads' events only (not XLA's op view)."""
    import gzip

    def meta(pid, tid, kind, name):
        return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}

    def x(pid, tid, ts, dur, name, **kw):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, **kw}

    events = [meta(1, 0, "process_name", "/host:CPU"), meta(1, 5, "thread_name", "python3"),
              meta(2, 0, "process_name", "/device:GPU:0"),
              meta(2, 7, "thread_name", "Stream #7(Compute)"), meta(2, 8, "thread_name", "XLA Ops"),
              x(2, 7, 10.0, 2.0, "flush"), x(2, 7, 30.0, 4.0, "walk"), x(2, 7, 36.0, 1.5, "out"),
              x(2, 8, 30.0, 4.0, "op view"), x(2, 7, 60.0, 2.0, "flush"),
              x(2, 7, 70.0, 3.0, "walk"),
              x(1, 5, 25.0, 20.0, traces.call_label(0)), x(1, 5, 65.0, 20.0, traces.call_label(1))]
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    device, host = traces.jax_events(traces.load(str(tmp_path)))
    assert [e[2] for e in device] == ["flush", "walk", "out", "flush", "walk"]
    assert host[0] == (25.0, 20.0, "[python3] <jcg call 0>")
    res = traces.per_call(device, host, 2)
    assert res["calls_ms"] == pytest.approx([5.5e-3, 3e-3]) and res["launches"] == [2, 1]
    assert res["device_ms"] == pytest.approx(4.25e-3) and res["reason"] is None
    res = traces.per_call(device, host, 3)
    assert res["calls_ms"][2] is None and "1 of 3 call ranges missing" in res["reason"]
    cpu_only = traces.jax_events(events[:2] + events[-2:])
    assert cpu_only[0] == [] and "no GPU activity at all" in traces.per_call(*cpu_only, 2)["reason"]
    # torch.profiler's export_chrome_trace: GPU activity by category, ranges as user annotations
    torch_events = [x(0, 1, 5.0, 1.0, "flush_kernel", cat="kernel"),
                    x(0, 1, 12.0, 2.0, "chunk_fwd", cat="kernel"),
                    x(0, 1, 14.5, 0.5, "Memcpy DtoD", cat="gpu_memcpy"),
                    x(0, 1, 12.0, 2.0, traces.call_label(0), cat="gpu_user_annotation"),
                    x(0, 2, 11.0, 2.0, "aten::add", cat="cpu_op"),
                    x(0, 2, 10.0, 6.0, traces.call_label(0), cat="user_annotation")]
    path = tmp_path / "torch.json"
    path.write_text(json.dumps({"traceEvents": torch_events}))
    res = traces.per_call(*traces.torch_events(traces.load(str(path))), 1)
    assert res["calls_ms"] == pytest.approx([2.5e-3]) and res["launches"] == [2]


def test_jax_device_times_trace_each_call_on_cpu():
    """The JAX profile runs (the ranges are in the trace), and on CPU reports no device time."""
    import jax
    import jax.numpy as jnp

    f, x = jax.jit(lambda x: x * 2), jnp.ones(8)
    res = frameworks.jax_device_times(lambda: f(x), 0, 2)
    assert res["device_ms"] is None and res["calls_ms"] == [None, None]
    assert res["reason"].startswith("2 of 2 calls without GPU activity")  # not "ranges missing"


def test_rel_rms_blocks_match_one_pass():
    import numpy as np

    rng = np.random.default_rng(1)
    ref = rng.standard_normal((3, 1001)).astype(np.float32)
    x = ref + 1e-3 * rng.standard_normal(ref.shape).astype(np.float32)
    want = np.linalg.norm((x - ref).astype(np.float64)) / np.linalg.norm(ref.astype(np.float64))
    for block in (7, 1000, 1 << 22):
        assert run.rel_rms(x, ref, block=block) == pytest.approx(want, rel=1e-12)
    x[1, 500] = np.nan
    assert np.isnan(run.rel_rms(x, ref, block=64))
    with pytest.raises(ValueError, match="elements"):
        run.rel_rms(x[:2], ref)


def test_ncu_stalls_reads_an_export(tmp_path, capsys):
    from benchmarks.profiling import ncu_stalls

    hdr = ["Address", "Source", ncu_stalls.SAMPLES, "stall_barrier", "stall_long_sb",
           "stall_barrier (Not Issued)"]
    rows = [["0x0", "LDG.E R2, [R4]", "3", "0", "3", "0"],
            ["0x10", "BAR.SYNC.DEFER_BLOCKING 0x0", "1", "1", "0", "1"],
            ["0x20", "FADD R1, R2, R3", "10", "9", "1", "9"],
            ["0x30", "EXIT", "0", "0", "0", "0"]]
    lines = ['"Kernel Name","k(int)"', ",".join(f'"{h}"' for h in hdr)]
    lines += [",".join(f'"{c}"' for c in r) for r in rows]
    path = tmp_path / "k.csv"
    path.write_text("\n".join(lines) + "\n")
    instrs = ncu_stalls.read_sass_csv(str(path))
    assert [i.samples for i in instrs] == [3, 1, 10, 0]
    assert ncu_stalls.by_reason(instrs) == {"stall_barrier": 10, "stall_long_sb": 4}
    assert [(a, b, s) for a, b, _, s in ncu_stalls.regions(instrs, ["BAR.SYNC"])] == \
        [(0, 1, 4), (2, 3, 10)]
    assert ncu_stalls.main([str(path), "--top", "2", "--split", "BAR.SYNC"]) == 0
    out = capsys.readouterr().out
    assert "14 samples" in out and "barrier 71.4%" in out
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="--page source"):
        ncu_stalls.read_sass_csv(str(bad))


def test_tiles_option_traces_under_walk_column_tiles():
    import types

    from jax_cake_gdn.primitives import cuda

    assert arms.make_arm("cuda:full:tiles1").options["walk_column_tiles"] == 1
    assert "walk_column_tiles" not in arms.make_arm("cuda").options
    for bad in ("cuda:tiles3", "cuda:tiles"):
        with pytest.raises(ValueError, match="unknown option"):
            arms.make_arm(bad)
    with arms._walk_tiles(None, 2):
        assert cuda._WALK_TILES[-1] == 2
    assert cuda._WALK_TILES[-1] == 0
    old = types.SimpleNamespace(__name__="old", primitives=types.SimpleNamespace())
    with pytest.raises(arms.ArmUnavailable, match="no walk_column_tiles"):
        arms._walk_tiles(old, 1)
    # the option runs an arm end to end (xla: the switch is set while it traces, and unused)
    w = workloads.get("tiny")
    call = arms.make_arm("xla:tiles2").setup(w, "fwd", w.make_inputs(0))
    assert call() is not None and cuda._WALK_TILES[-1] == 0
