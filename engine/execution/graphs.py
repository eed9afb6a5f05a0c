"""CUDA graphs for a step's compute: each compute instruction of a rank's program captured once and replayed.

Why: a stage program of a deep pipeline is short (two transformer blocks, 1.3-2.5 ms on an H100) and inductor's
wrapper launches its kernels from Python, so a rank's host needs about what its device does (4 x H200,
2026-11-27, zbv at p = 4: a program's launch from an idle device 0.5-2.4 ms against 1.3-2.5 ms of device time;
`benchmarks/diagnose_p2.py --host`). In a step the host also posts transfers, and a rank whose host falls
behind leaves its device idle between kernels: the programs ran 9-17 % slower in a step than timed alone.
Replayed as one CUDA graph each, a program is launched in 0.01-0.06 ms and its kernels run back to back.

How, the way Megatron-LM graphs a pipeline's microbatches: the step's program is static, so every compute
instruction gets its own graph, captured in program order into one memory pool during one step (the second:
the first runs eagerly, so that any compile or autotuning is over), and replayed in the same order in every
later step. Values stay where the capture put them:
- A graph's outputs live in the pool. After capture the step drops them as usual (`free`), so a later capture
  reuses their memory exactly as the step's order allows; at replay the step gets non-owning tensors at the
  same addresses (`_Tensor.rebuild`), valid while the graphs live. During the capture step no send is retired
  before the step's end, so no graph writes where a transfer may still read.
- Every other input (parameters, batch leaves, received tensors, the loss's share) is held from the capture
  step: at replay a different tensor is copied into it first (`copy_`; the same tensor costs nothing).
- Grad accumulators are the executor's own, zeroed at their first use in each step (`Executor.accumulator`);
  a step hands out copies of them.
Anything a graph cannot take (a program with random ops; a capture that fails; an input whose shape or
pool address differs at replay) turns graphs off for the rest of the executor's life, and that instruction and
every later one run as before; the warning says why. `FNPIPE_CUDA_GRAPHS` = 1 / 0 turns them on or off
(`enabled`).
"""
from __future__ import annotations

import logging
import os
import re
import weakref
from typing import Any, Callable, Sequence

import attrs
import torch

from ..errors import PlanError

log = logging.getLogger("engine.runtime")

# an equation `v = op ...` whose op draws random numbers (a replay would repeat the capture's draws)
RANDOM = re.compile(r"= (?:rand\w*|bernoulli\w*|\w*dropout\w*|normal\w*|multinomial|poisson|exponential\w*|"
                    r"geometric\w*|cauchy\w*|uniform\w*|log_normal\w*)\b")
SWITCH = "FNPIPE_CUDA_GRAPHS"
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def enabled(device: torch.device) -> bool:
    """Whether a step on `device` replays CUDA graphs: CUDA only, and `FNPIPE_CUDA_GRAPHS` (default off)."""
    value = os.environ.get(SWITCH, "0").strip().lower()
    if value not in ON + OFF:
        raise PlanError(f"{SWITCH}={value!r}: set it to 1 (replay each compute as a CUDA graph) or 0 (none)")
    return device.type == "cuda" and value in ON


@attrs.frozen
class _Tensor:
    """Where a tensor lives: enough to make a non-owning tensor at the same place."""

    storage_ptr: int
    storage_nbytes: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Tensor:
        s = t.untyped_storage()
        return cls(s.data_ptr(), s.nbytes(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def rebuild(self, device: torch.device) -> torch.Tensor:
        storage = torch._C._construct_storage_from_data_pointer(self.storage_ptr, device, self.storage_nbytes)
        return torch.empty((), dtype=self.dtype, device=device).set_(storage, self.offset, self.shape, self.stride)

    def fits(self, t: torch.Tensor) -> bool:
        return tuple(t.shape) == self.shape and t.dtype == self.dtype


@attrs.define
class _Input:
    """One argument of a captured instruction: made by an earlier graph (`made`: its place) or held."""

    made: _Tensor | None = None
    held: torch.Tensor | None = None


@attrs.define
class _Captured:
    graph: Any
    inputs: list[_Input | None]
    outputs: list[_Tensor | None]
    single: bool  # the program returned one tensor, not a sequence


class Mismatch(Exception):
    """An input at replay that the captured graph cannot take."""


class Graphs:
    """The CUDA graphs of one executor's compute instructions (see the module). States: "warm" (the first step
    runs eagerly), "capture" (this step captures each instruction and replays it at once), "replay", "off"."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state = "warm"
        cuda = device.type == "cuda"  # elsewhere only a subclass that records its own graphs (the tests')
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.captured: dict[int, _Captured] = {}
        self.made: dict[int, tuple[weakref.ref, _Tensor]] = {}  # id(tensor) -> (the tensor, its place): this step
        self.retired: list[dict[int, _Captured]] = []  # graphs given up: kept, their pool may still be read
        self.random: dict[Any, bool] = {}

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        return self.state == "capture"

    @property
    def active(self) -> bool:
        """Capturing or replaying: accumulators are the executor's own and get copied out at the step's end."""
        return self.state in ("capture", "replay")

    def begin_step(self) -> None:
        self.made = {}
        if self.state == "warm" and getattr(self, "_warmed", False):
            self.state = "capture"
        self._warmed = True

    def end_step(self, ok: bool) -> None:
        self.made = {}
        if self.state == "capture":
            if ok:
                self.state = "replay"
                log.info("CUDA graphs: %d compute instructions captured", len(self.captured))
            else:
                self.off("the step that captured them failed")

    def off(self, why: str) -> None:
        if self.state != "off":
            log.warning("CUDA graphs off for this step and every later one: %s", why)
        self.state = "off"
        if self.captured:
            self.retired.append(self.captured)
        self.captured = {}

    # -- one instruction --------------------------------------------------------------------------------------
    def run(self, key: int, program: Any, fn: Callable[..., Any], args: Sequence[Any], text: Callable[[], str]
            ) -> Any:
        """`fn(*args)` for compute instruction `key` (id of the instruction) of program `program` (its (stage,
        kind, accumulate)); `text()` prints the program (checked once for random ops)."""
        if self.state == "replay":
            found = self.captured.get(key)
            if found is not None:
                try:
                    return self._replay(found, args)
                except Mismatch as e:
                    self.off(str(e))
        elif self.state == "capture":
            if program not in self.random:
                self.random[program] = bool(RANDOM.search(text()))
            if self.random[program]:
                self.off(f"program {program} draws random numbers (a graph would replay the same draws)")
            else:
                try:
                    return self._capture(key, fn, args)
                except Exception as e:  # noqa: BLE001 -- any capture failure: run eagerly from here on
                    self.off(f"capturing program {program} failed: {type(e).__name__}: {e}")
        return fn(*args)

    def record(self, fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, Any]:
        """(a graph of `fn(*args)` that has not run yet, its outputs): captured on a side stream into the pool,
        other threads free to use CUDA meanwhile (the NCCL watchdog, the copy engines' watch)."""
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outs = fn(*args)
            finally:
                graph.capture_end()
        return graph, outs

    def _capture(self, key: int, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        inputs = [None if not isinstance(a, torch.Tensor) else self._classify(a) for a in args]
        graph, outs = self.record(fn, args)
        graph.replay()  # on the step's stream: this step's values
        single = not isinstance(outs, (tuple, list))
        flat = [outs] if single else list(outs)
        places = [_Tensor.of(t) if isinstance(t, torch.Tensor) else None for t in flat]
        for t, place in zip(flat, places):
            if place is not None:
                self.made[id(t)] = (weakref.ref(t), place)
        self.captured[key] = _Captured(graph, inputs, places, single)
        return outs

    def _classify(self, t: torch.Tensor) -> _Input:
        entry = self.made.get(id(t))
        if entry is not None and entry[0]() is t:
            return _Input(made=entry[1])
        return _Input(held=t)

    def _replay(self, found: _Captured, args: Sequence[Any]) -> Any:
        if len(args) != len(found.inputs):
            raise Mismatch(f"{len(args)} arguments where the graph took {len(found.inputs)}")
        for a, slot in zip(args, found.inputs):
            if slot is None:
                continue
            if slot.made is not None:
                if a.data_ptr() != slot.made.storage_ptr + slot.made.offset * a.element_size() or not slot.made.fits(a):
                    raise Mismatch("an input made by an earlier graph is not where the capture had it")
            elif a is not slot.held and a.data_ptr() != slot.held.data_ptr():
                if tuple(a.shape) != tuple(slot.held.shape) or a.dtype != slot.held.dtype:
                    raise Mismatch(f"an input of shape {tuple(a.shape)} {a.dtype} where the capture had "
                                   f"{tuple(slot.held.shape)} {slot.held.dtype}")
                slot.held.copy_(a)
        found.graph.replay()
        outs = [None if p is None else p.rebuild(self.device) for p in found.outputs]
        for t, place in zip(outs, found.outputs):
            if place is not None:
                self.made[id(t)] = (weakref.ref(t), place)
        return outs[0] if found.single else tuple(outs)

    def close(self) -> None:
        self.captured, self.retired, self.made = {}, [], {}
        self.state = "off"


def pool_bytes(graphs: Graphs | None) -> int:
    """Bytes the graphs' pool holds on the device (its segments), 0 without graphs."""
    if graphs is None or not (graphs.captured or graphs.retired):
        return 0
    pool = tuple(graphs.pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) == pool)
