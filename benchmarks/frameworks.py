"""What an arm's framework gives the runner: its sync, its L2 flush, its device-time profiler.

The runner syncs, flushes and profiles an arm only through the arm's own framework, so a timed
call never includes a hand-off between frameworks (a JAX flush before a torch call would add
one). Each framework:

- `sync(result)`: blocks until the device has finished the call (`jax.block_until_ready`;
  `torch.cuda.synchronize()`).
- `flush(mib)`: an L2 flush, a read and write of a `mib` MiB device buffer (kept between calls),
  waited for; nothing when `mib <= 0`. JAX writes one buffer per local device (the kcp arms use
  several), torch one on the current CUDA device.
- `device_times(call, mib, n)`: `n` calls, each after a flush, under the framework's profiler
  (`jax.profiler.trace`; `torch.profiler` with CUDA activities), each marked with a host range;
  returns `benchmarks.traces.per_call`'s dict (device ms per call and their median, or None
  with the reason: no GPU, no GPU activity in the trace).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, Callable, Dict

from benchmarks import traces


@dataclasses.dataclass(frozen=True)
class Framework:
    name: str
    sync: Callable[[Any], None]
    flush: Callable[[int], None]
    device_times: Callable[[Callable[[], Any], int, int], Dict[str, Any]]


# ------------------------------------------------------------------------------------------------
# JAX
# ------------------------------------------------------------------------------------------------

_JAX_FLUSH: Dict[int, list] = {}  # mib -> one buffer per local device
_JAX_BUMP = []


def jax_sync(res) -> None:
    import jax

    jax.block_until_ready(res)


def jax_flush(mib: int) -> None:
    if mib <= 0:
        return
    import jax
    import jax.numpy as jnp

    if not _JAX_BUMP:
        _JAX_BUMP.append(jax.jit(lambda b: b + 1.0, donate_argnums=0))
    bufs = _JAX_FLUSH.get(mib)
    if bufs is None:
        bufs = [jnp.zeros((mib * 2**20 // 4,), jnp.float32, device=d) for d in jax.local_devices()]
    _JAX_FLUSH[mib] = bufs = [_JAX_BUMP[0](b) for b in bufs]
    jax.block_until_ready(bufs)


def jax_device_times(call, mib: int, n: int) -> Dict[str, Any]:
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(n):
                jax_flush(mib)
                with jax.profiler.TraceAnnotation(traces.call_label(i)):
                    jax_sync(call())
        events = traces.load(d)
    # no GPU activity on a host without a GPU, or where another profiler holds CUPTI
    return traces.per_call(*traces.jax_events(events), n)


JAX = Framework("jax", jax_sync, jax_flush, jax_device_times)


# ------------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------------

_TORCH_FLUSH: Dict[int, Any] = {}  # mib -> buffer on the current CUDA device


def torch_sync(_res) -> None:
    import torch

    torch.cuda.synchronize()


def torch_flush(mib: int) -> None:
    if mib <= 0:
        return
    import torch

    buf = _TORCH_FLUSH.get(mib)
    if buf is None:
        buf = _TORCH_FLUSH[mib] = torch.zeros(mib * 2**20 // 4, dtype=torch.float32,
                                              device="cuda")
    buf.add_(1.0)
    torch.cuda.synchronize()


def torch_device_times(call, mib: int, n: int) -> Dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            torch_flush(mib)
            with record_function(traces.call_label(i)):
                res = call()
                torch.cuda.synchronize()
            del res
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = traces.load(path)
    return traces.per_call(*traces.torch_events(events), n)


TORCH = Framework("torch", torch_sync, torch_flush, torch_device_times)
