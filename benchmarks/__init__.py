"""Benchmarks for jax-cake-gdn: the timing protocol of docs/design.md.

    python -m benchmarks.run --workload B23 --ops fwd,fwd+bwd,ckpt --arms xla,cuda

`workloads` holds the shapes and the floor model, `arms` the things being timed, `frameworks`
each arm's sync, L2 flush and device-time profiler, `traces` the profiler traces, `run` the
protocol and the report, `plot` the plots; `profiling/` the tools that find where the time goes.
"""
