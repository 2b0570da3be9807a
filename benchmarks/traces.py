"""Profiler traces (Chrome trace format) and the device time of each marked call in them.

Both profilers write the Chrome trace format: `jax.profiler.trace` a `*.trace.json.gz` under
`<dir>/plugins/profile/<run>/`, `torch.profiler`'s `export_chrome_trace` a `.json`. An event is
`(start_us, dur_us, name)`. The runner marks each profiled call with a host range named
`call_label(i)` (a `jax.profiler.TraceAnnotation` or `torch.profiler.record_function` around the
call and its sync, the L2 flush outside it); a call's device time is the sum of the durations of
the GPU activities (kernels, copies, memsets) that start inside its range.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import statistics
from typing import Dict, List, Optional, Tuple

Event = Tuple[float, float, str]

# torch.profiler's categories of GPU activity (its chrome trace's "cat")
TORCH_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

_LABEL = re.compile(r"<jcg call (\d+)>")


def call_label(i: int) -> str:
    return f"<jcg call {i}>"


def load(path: str) -> List[dict]:
    """The trace events of a trace file (.json or .json.gz), or of the newest jax.profiler trace
    under a folder."""
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "plugins", "profile", "*", "*.trace.json.gz"))
        if not files:
            raise RuntimeError(f"no *.trace.json.gz under {path}/plugins/profile")
        path = max(files, key=os.path.getmtime)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _x(e: dict, name: str) -> Event:
    return float(e["ts"]), float(e.get("dur", 0.0)), name


def jax_events(events: List[dict]) -> Tuple[List[Event], List[Event]]:
    """(device, host) events of a jax.profiler trace, each sorted: device = the events of the GPU
    processes' stream threads (none on a host without a GPU), host = every other process's (name
    prefixed by its thread's)."""
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    gpu = {p for p, n in pname.items() if "GPU" in n}
    streams = {k for k, n in tname.items() if k[0] in gpu and n.startswith("Stream")}
    device, host = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e["pid"], e["tid"])
        if key in streams:
            device.append(_x(e, e["name"]))
        elif e["pid"] not in gpu:
            host.append(_x(e, f"[{tname.get(key, e['tid'])}] {e['name']}"))
    return sorted(device), sorted(host)


def torch_events(events: List[dict]) -> Tuple[List[Event], List[Event]]:
    """(device, host) events of a torch.profiler chrome trace, each sorted: device = GPU
    activities (TORCH_DEVICE_CATS), host = the user annotations (record_function ranges)."""
    device, host = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in TORCH_DEVICE_CATS:
            device.append(_x(e, e["name"]))
        elif e.get("cat") == "user_annotation":
            host.append(_x(e, e["name"]))
    return sorted(device), sorted(host)


def call_ranges(host: List[Event]) -> Dict[int, Tuple[float, float]]:
    """{i: (start_us, end_us)} of the `call_label(i)` ranges among the host events."""
    out = {}
    for ts, dur, name in host:
        m = _LABEL.search(name)
        if m:
            out[int(m.group(1))] = (ts, ts + dur)
    return out


def in_range(device: List[Event], r: Tuple[float, float]) -> List[Event]:
    """The device events that start inside the range r."""
    return [e for e in device if r[0] <= e[0] <= r[1]]


def per_call(device: List[Event], host: List[Event], n: int) -> Dict[str, object]:
    """Device time of calls 0..n-1 from their `call_label` ranges in `host`.

    Returns {"calls_ms": [ms or None per call], "launches": [count per call], "device_ms":
    median of the calls that have one (None if none), "reason": why device_ms is None or a call
    lacks a time (else None)}."""
    ranges = {i: r for i, r in call_ranges(host).items() if i < n}
    calls: List[Optional[float]] = []
    launches: List[int] = []
    for i in range(n):
        inside = in_range(device, ranges[i]) if i in ranges else []
        calls.append(sum(e[1] for e in inside) / 1e3 if inside else None)
        launches.append(len(inside))
    got = [c for c in calls if c is not None]
    reason = None
    if len(ranges) < n:
        reason = f"{n - len(ranges)} of {n} call ranges missing from the trace"
    elif len(got) < n:
        reason = (f"{n - len(got)} of {n} calls without GPU activity in the trace"
                  + ("" if device else " (the trace has no GPU activity at all)"))
    return {"calls_ms": calls, "launches": launches,
            "device_ms": statistics.median(got) if got else None, "reason": reason}
