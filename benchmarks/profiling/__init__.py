"""Profiling aids: where the time of one op goes (not the protocol runner, `benchmarks.run`).

`kernels` times each primitive alone, `device_times` lists every launch's device time under
Nsight Compute, `host_time` splits a call into dispatch and device time (and reads a
jax.profiler timeline), `ncu_stalls` sums one kernel's warp-stall samples by region.
"""
