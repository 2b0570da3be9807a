"""Benchmarks for jax-cake-gdn: the timing protocol of DESIGN.md section 5.

    python -m benchmarks.run --workload B23 --ops fwd,fwd+bwd,ckpt --arms xla,cuda

`workloads` holds the shapes and the floor model, `arms` the things being timed, `run` the
protocol (flush, warm-up, palindromic groups, medians, drift) and the report.
"""
