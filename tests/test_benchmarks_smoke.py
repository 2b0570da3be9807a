"""Smoke tests of the benchmark runner and the demo on CPU. Never asserts timings."""

import json

import pytest

from benchmarks import run, workloads


def test_floor_matches_design():
    # DESIGN.md section 5: FLOP floor 0.35 / 1.35 ms (B23), 0.70 / 2.7 (long), 0.09 / 0.34 (small heads).
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


@pytest.mark.parametrize("name,ops,arms", [("tiny", ["fwd", "fwd+bwd", "ckpt"], ["xla", "cuda"]),
                                           ("tiny-layer", ["fwd+bwd"], ["xla", "xla:full"])])
def test_runner_end_to_end(tmp_path, name, ops, arms):
    # cuda: runs on a GPU build, else is reported under "skipped" with the reason.
    res = run.main(["--workload", name, "--ops", ",".join(ops), "--arms", ",".join(arms),
                    "--groups", "1", "--calls", "2", "--warmup", "1", "--out", str(tmp_path),
                    "--tag", "smoke"])
    path = tmp_path / f"{name}_smoke.json"
    data = json.loads(path.read_text())
    for key in ("schema", "workload", "device", "versions", "config", "floor", "results", "skipped"):
        assert key in data
    assert data["versions"]["jax"] and data["device"]["platform"]
    got = {(r["arm"], r["op"]) for r in data["results"]}
    for op in ops:
        assert ("xla", op) in got
        for arm in arms:
            assert (arm, op) in got or (arm == "cuda" and any(
                s["arm"] == "cuda" and s["op"] == op for s in data["skipped"]))
    for r in data["results"]:
        assert len(r["times_ms"]) == 1 and len(r["times_ms"][0]) == 2
        for k in ("median_ms", "drift", "speedup_vs_baseline", "floor_fraction", "group_medians_ms"):
            assert k in r
        # dispatch is the part of each call before its sync: never more than the call
        assert 0.0 < r["dispatch_median_ms"] <= r["median_ms"]
        assert len(r["dispatch_group_medians_ms"]) == 1
        if r["arm"] == "xla:full":  # full and light give equal results (DESIGN.md: bitwise)
            assert r["check"]["max_rel_rms"] == 0.0
    assert res["path"] == str(path)


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
    # gdn_kcp over 2 of the 8 host devices equals gdn (checked against the xla arm), the
    # exchange-only arm runs, and every JAX row reports its compiled peak bytes.
    arms = ["xla", "kcp:2:xla", "kcp:2:zigzag:ring:xla:P2", "kcp:2:xla:xonly"]
    res = run.main(["--workload", "tiny", "--ops", "fwd,fwd+bwd", "--arms", ",".join(arms),
                    "--groups", "1", "--calls", "2", "--warmup", "1", "--out", str(tmp_path),
                    "--tag", "kcp"])
    got = {(r["arm"], r["op"]): r for r in res["results"]}
    assert not res["skipped"], res["skipped"]
    for op in ("fwd", "fwd+bwd"):
        for arm in arms:
            assert got[arm, op]["peak_bytes"] > 0
        for arm in arms[1:3]:
            assert got[arm, op]["check"]["max_rel_rms"] <= 1e-2, (arm, op)  # bf16 outputs
        assert "check" not in got[arms[3], op]


def test_kernel_times_end_to_end(tmp_path):
    """benchmarks.profiling.kernels times every primitive of one fwd + bwd (xla backend here) and writes
    its JSON; the rows name each primitive once, and the whole-op rows come last."""
    from benchmarks.profiling import kernels

    res = kernels.main(["--workload", "tiny", "--backend", "xla", "--calls", "1",
                        "--out", str(tmp_path)])
    rows = list(res["median_ms"])
    assert rows[:4] == ["fwd: l2norm_rstd (q or k)", "fwd: gate_cumsum", "fwd light: solve_a",
                        "fwd light: walk_output"]
    assert {"fwd full: walk_output, tapes", "transfer walk: prep", "bwd: walk_bwd",
            "bwd: chunk_bwd", "bwd light: replay"} <= set(rows)
    assert rows[-4:] == ["gdn fwd light", "gdn fwd full", "gdn fwd+bwd light", "gdn fwd+bwd full"]
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
        assert "jcg_base_walk_output" in texts["base"], texts["base"][-2000:]
        assert "jax_cake_gdn_" not in texts["base"], "base lowered to the library's targets"
        assert "jcg_base_" not in texts["cur"] and "jax_cake_gdn_walk_output" in texts["cur"]
        # per-primitive A/B in one process (xla primitives here: they run on any host)
        import os
        from benchmarks.profiling import kernels
        os.environ[baseline.ENV] = {str(dest)!r}
        res = kernels.main(["--workload", "tiny", "--backend", "xla", "--calls", "1", "--base"])
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


# A trimmed `ncu --csv --metrics gpu__time_duration.sum` output of the session-9 run (H200).
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
    """benchmarks.profiling.device_times: launches in order with ms (ns, us units, thousands separators),
    short names, per-kernel totals; a clear exit code when ncu is missing. The ncu run itself
    needs a GPU (not run here)."""
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

    for op in ("fwd", "fwd+bwd"):
        assert dt.main([dt._CHILD, "--workload", "tiny", "--ops", op, "--modes", "light",
                        "--backend", "xla"]) == 0


def test_host_time_runs():
    from benchmarks.profiling import host_time

    rows = host_time.main(["--workload", "tiny", "--arms", "xla,xla:full", "--calls", "2",
                           "--flush-mib", "0"])
    assert [r["arm"] for r in rows] == ["xla", "xla:full"]
    for r in rows:
        assert 0 < r["dispatch_ms"] <= r["call_ms"]  # each call returns before its sync ends
        assert r["call_min_ms"] <= r["call_ms"] and r["back_to_back_ms"] > 0


def test_host_time_reads_a_trace(tmp_path):
    """--trace's reader: the GPU stream events of the newest trace, sorted; host events apart."""
    import gzip

    from benchmarks.profiling import host_time

    def meta(pid, tid, kind, name):
        return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}

    events = [meta(1, 0, "process_name", "/host:CPU"), meta(1, 5, "thread_name", "python3"),
              meta(2, 0, "process_name", "/device:GPU:0"),
              meta(2, 7, "thread_name", "Stream #7(Compute)"),
              meta(2, 8, "thread_name", "XLA Ops"),
              {"ph": "X", "pid": 2, "tid": 7, "ts": 30.0, "dur": 4.0, "name": "walk"},
              {"ph": "X", "pid": 2, "tid": 7, "ts": 10.0, "dur": 2.0, "name": "flush"},
              {"ph": "X", "pid": 2, "tid": 8, "ts": 30.0, "dur": 4.0, "name": "op view"},
              {"ph": "X", "pid": 1, "tid": 5, "ts": 1.0, "dur": 50.0, "name": "call"}]
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    device, host = host_time.trace_events(str(tmp_path))
    assert device == [(10.0, 2.0, "flush"), (30.0, 4.0, "walk")]
    assert host == [(1.0, 50.0, "[python3] call")]
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events[:2]}, f)
    with pytest.raises(RuntimeError, match="no GPU stream threads"):
        host_time.trace_events(str(tmp_path))


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
