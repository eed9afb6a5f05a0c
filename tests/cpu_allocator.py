"""The CPU allocator's peak over a call, read from torch.profiler's memory events: what the memory tests
compare fnpipe's predictions with (on GPU the benchmark reads torch.cuda.max_memory_allocated)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile


def allocator_peak(fn: Callable[[], Any]) -> int:
    """The most bytes the CPU allocator held during `fn()` beyond what it held when `fn` started: the
    profiler's running total at each allocation or free, less the total before its first event. Frees of
    blocks allocated before the window are not reported, so call it with nothing dying inside `fn` that
    was made outside it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - base
