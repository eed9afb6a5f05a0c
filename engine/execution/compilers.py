"""Stage program compilers ("fx", "inductor", "auto"), inductor's compile cache, and compile times per stage.

- "fx" runs a program as generated Python calling ATen ops one by one: eager's kernels, no compile time.
- "inductor" compiles it with torch.compile (fused kernels, static shapes): faster steps, a compile per
  distinct program.
- "auto" (the default) is inductor where it pays, on CUDA, and fx elsewhere: on a CPU inductor's C++
  kernels rarely beat ATen's for these programs and the compile costs a C++ toolchain and minutes.

Compile time is paid once. Within a process, programs that print alike (the middle stages of a model of
identical layers, or the same stage planned again for another schedule) share one compiled callable: the
key is the program's text, its constants and which outputs are accumulated. Across runs, inductor's own
FX graph cache keeps the compiled kernels on disk: `TORCHINDUCTOR_CACHE_DIR` if the user set it, else
`<plan cache>/inductor` when `parallelize` got a plan cache directory, else inductor's default directory
(one per user under the temp dir). A warm cache leaves dynamo's trace and the cache lookups: seconds.

Each compile is timed at its first call (torch.compile is lazy), with the FX graph cache's hits and misses
over it; `CompileLog` keeps them per (stage, program kind) for the logs and `engine.report`.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

import ir

from ..errors import PlanError

log = logging.getLogger("engine.compile")
Compiled = Callable[..., Any]
Compiler = Callable[[ir.Graph, tuple[int, ...]], Compiled]

AUTO = {"cuda": "inductor"}  # device type -> what "auto" compiles with there; fx elsewhere


@attrs.frozen
class CompileTime:
    """One program's first call: seconds (compile plus one run), and the FX graph cache's hits and misses."""

    seconds: float
    hits: int = 0
    misses: int = 0
    shared: bool = False  # an identical program compiled earlier in this process was reused


class _Timed:
    """A compiled program that times its first call (where torch.compile compiles) into `record`."""

    def __init__(self, fn: Compiled, record: Callable[[CompileTime], None]) -> None:
        self.fn, self.record, self.done = fn, record, False

    def __call__(self, *args: Any) -> Any:
        if self.done:
            return self.fn(*args)
        hits, misses = _cache_counts()
        start = time.perf_counter()
        out = self.fn(*args)
        seconds = time.perf_counter() - start
        h, m = _cache_counts()
        self.done = True
        self.record(CompileTime(seconds, h - hits, m - misses))
        return out


def _cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


_SHARED: dict[tuple[Any, ...], Compiled] = {}  # (program key, C++ wrapper) -> compiled, for this process


def program_key(graph: ir.Graph, accumulate: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """What a compiled program depends on: its printed text and its tensor constants (digested), and the
    outputs it accumulates. Programs with equal keys compute the same function."""
    return ir.program_digest(graph), tuple(accumulate)


CPP_WRAPPER = "FNPIPE_CPP_WRAPPER"
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def cpp_wrapper() -> bool:
    """`FNPIPE_CPP_WRAPPER` = 1 / 0 (default 0): inductor's C++ wrapper around each compiled program, which
    launches its kernels from C++ instead of generated Python. A stage program of a deep pipeline is short
    and its host needs about what its device does (zbv at p = 4: a program's launch from an idle device
    0.41-1.04 x its device time, `benchmarks/diagnose_p2.py --host`, 4 x H200, 2026-11-27); the C++ wrapper
    halved those launch costs there (GPT). A value it cannot mean raises PlanError (`engine.init` asks
    first, on every rank, before any communication)."""
    value = os.environ.get(CPP_WRAPPER, "0").strip().lower()
    if value not in ON + OFF:
        raise PlanError(f"{CPP_WRAPPER}={value!r}: set it to 1 (inductor's C++ wrapper) or 0 (its Python wrapper)")
    return value in ON


def inductor(graph: ir.Graph, accumulate: tuple[int, ...]) -> Compiled:
    """The fx program of `graph` compiled by torch.compile's inductor, shared by identical programs; with
    `cpp_wrapper()` in inductor's C++ wrapper, or its Python wrapper where that fails to compile."""
    cpp = cpp_wrapper()
    key = (*program_key(graph, accumulate), cpp)
    if key not in _SHARED:
        ir.require_runnable(graph)
        fx = ir.to_fx(graph, accumulate)  # op overloads, as torch.compile traces them (not `ir.compile_graph`'s)
        python = _compiled(fx, cpp=False)
        _SHARED[key] = _Fallback(_compiled(fx, cpp=True), python) if cpp else python
    return _SHARED[key]


def _compiled(fx: Compiled, *, cpp: bool) -> Compiled:
    return torch.compile(fx, backend="inductor", fullgraph=True, dynamic=False,
                         options={"cpp_wrapper": True} if cpp else None)


class _Fallback:
    """`first` (the C++-wrapped program), or `second` from the first call on where compiling `first` failed:
    inductor's BackendCompilerFailed, raised before any kernel ran, so no accumulator was touched."""

    def __init__(self, first: Compiled, second: Compiled) -> None:
        self.fn, self.second, self.tried = first, second, False

    def __call__(self, *args: Any) -> Any:
        if self.tried:
            return self.fn(*args)
        from torch._dynamo.exc import BackendCompilerFailed

        try:
            out = self.fn(*args)
        except BackendCompilerFailed as err:
            log.warning("inductor's C++ wrapper failed to compile a stage program (%s); it runs in the Python "
                        "wrapper instead", str(err).splitlines()[0][:300])
            self.fn = self.second
            out = self.fn(*args)
        self.tried = True
        return out


COMPILERS: dict[str, Compiler] = {
    "fx": ir.compile_graph,  # generated Python calling ATen ops one by one: eager's per-op cost
    "inductor": inductor,
}
CHOICES = (*COMPILERS, "auto")


def check_compiler(name: str) -> str:
    if name not in CHOICES:
        raise ValueError(f"compiler must be one of {', '.join(map(repr, CHOICES))}, got {name!r}")
    return name


def resolve(name: str, device: torch.device | str) -> str:
    """The compiler `name` means on `device`: "auto" is inductor on CUDA, fx elsewhere."""
    check_compiler(name)
    if name != "auto":
        return name
    return AUTO.get(torch.device(device).type, "fx")


def use_cache_dir(plan_cache: str | os.PathLike | None) -> str | None:
    """Point inductor's on-disk cache at `<plan_cache>/inductor` unless TORCHINDUCTOR_CACHE_DIR is set (or
    there is no plan cache directory: inductor's default then). Returns the directory in use, if known."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    if plan_cache is None:
        return None
    root = Path(plan_cache)
    root = root.parent if root.suffix == ".json" else root  # a deployment file: its directory
    where = str((root / "inductor").resolve())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where


class CompileLog:
    """Compile times of one rank's programs, by (stage, program kind): what `engine.report` prints."""

    def __init__(self) -> None:
        self.times: dict[tuple[int, str], CompileTime] = {}
        self._seen: set[tuple[Any, ...]] = set()

    def wrap(self, compiler: Compiler, stage: int, kind: str, graph: ir.Graph,
             accumulate: tuple[int, ...]) -> Compiled:
        """`compiler(graph, accumulate)`, its first call timed into this log (fx compiles nothing: not logged)."""
        if compiler is ir.compile_graph:
            return compiler(graph, accumulate)
        key = program_key(graph, accumulate)
        key = (*key, cpp_wrapper()) if compiler is inductor else key
        shared = key in _SHARED or key in self._seen
        self._seen.add(key)
        fn = compiler(graph, accumulate)

        def record(t: CompileTime) -> None:
            t = attrs.evolve(t, shared=shared)
            self.times[(stage, kind)] = t
            log.info("stage %d %s: compiled in %.2f s (%s)", stage, kind, t.seconds, describe(t))

        return _Timed(fn, record)

    def per_stage(self) -> dict[int, float]:
        """Seconds spent compiling each stage's programs (first calls)."""
        out: dict[int, float] = {}
        for (stage, _), t in self.times.items():
            out[stage] = out.get(stage, 0.0) + t.seconds
        return out


def describe(t: CompileTime) -> str:
    if t.shared:
        return "an identical program compiled earlier in this process"
    return f"FX graph cache: {t.hits} hits, {t.misses} misses"
