"""CUDA graphs for a step's compute: each compute instruction of a rank's program captured once and replayed.

Why: a stage program of a deep pipeline is short (two transformer blocks, 1.3-2.5 ms on an H100) and inductor's
wrapper launches its kernels from Python, so a rank's host needs about what its device does (4 x H200,
2026-11-27, zbv at p = 4: a program's launch from an idle device 0.4-1.04 x its device time;
`benchmarks/diagnose_p2.py --host`). In a step the host also posts transfers, and a rank whose host falls
behind leaves its device idle between kernels. Replayed as one CUDA graph, a program is launched in
0.01-0.06 ms and its kernels run back to back.

How, the way Megatron-LM graphs a pipeline's microbatches: the step's program is static, so every compute
instruction gets its own graph, captured in program order into one memory pool during one step (the second:
the first runs eagerly, so that any compile or autotuning is over), and replayed in the same order in every
later step. Programs are pure (`ir.trace` refuses random ops; dropout is keyed arithmetic on the batch), so a
replay computes what the program would. Values stay where the capture put them:
- A graph's outputs live in the pool. After capture the step drops them as usual (`free`), so a later capture
  reuses their memory exactly as the step's order allows; at replay the step gets non-owning tensors at the
  same addresses (`_Tensor.rebuild`), valid while the graphs live. An output that is a view of an input (B
  handing W a view of a received gradient) lives on that input's storage, which stays where the capture read it
  too, so it is placed alike, not held as a new input by the graph that reads it. During the capture step no
  send is retired before the step's end, so no graph writes where a transfer may still read.
- The user's tensors (parameters, batch leaves) are never written: the capture reads clones of them, one per
  tensor however many programs read it, and a step copies a new tensor (or one changed in place since) into its
  clone before the first replay that reads it; a functional optimizer's new parameters cost one copy a step.
  The runtime's own inputs (received tensors, contiguous copies) are held from the capture step and a new one
  is copied in. Clones and held inputs are memory the graphs add, beside their pool.
- Grad accumulators are the executor's own, zeroed at their first use in each step (`Executor.accumulator`);
  a step hands out copies of them.
Anything a graph cannot take (a capture that fails; an input whose shape, layout or pool address differs at
replay; one tensor where the capture had two) turns graphs off for the rest of the executor's life: that
instruction and every later one run as before, the warning says why, and the graphs' memory goes at the next
step's end. `FNPIPE_CUDA_GRAPHS` = 1 / 0 turns them on or off (`enabled`).
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Collection, Sequence

import attrs
import torch

from ..errors import PlanError

log = logging.getLogger("engine.runtime")

SWITCH = "FNPIPE_CUDA_GRAPHS"
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch() -> bool:
    """`FNPIPE_CUDA_GRAPHS` (default off); a value it cannot mean raises PlanError (`engine.init` asks first, on
    every rank, before any communication)."""
    value = os.environ.get(SWITCH, "0").strip().lower()
    if value not in ON + OFF:
        raise PlanError(f"{SWITCH}={value!r}: set it to 1 (replay each compute as a CUDA graph) or 0 (none)")
    return value in ON


def enabled(device: torch.device) -> bool:
    """Whether a step on `device` replays CUDA graphs: CUDA only, and `FNPIPE_CUDA_GRAPHS` on."""
    return switch() and device.type == "cuda"


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

    def at(self, t: torch.Tensor) -> bool:
        """`t` is this place: same address, shape, strides and dtype."""
        return (t.dtype == self.dtype and tuple(t.shape) == self.shape and tuple(t.stride()) == self.stride
                and t.data_ptr() == self.storage_ptr + self.offset * t.element_size())


@attrs.define
class _Input:
    """One argument of a captured instruction: made by an earlier graph (`made`: its place) or `held` (the
    runtime's own tensor from the capture step, or the clone of a user's tensor) and copied into at replay."""

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


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


class Graphs:
    """The CUDA graphs of one executor's compute instructions (see the module). States: "warm" (the first step
    runs eagerly), "capture" (this step captures each instruction and replays it at once), "replay", "off"."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state = "warm"
        self.warmed = False  # a step ran to its end before the capture
        cuda = device.type == "cuda"  # elsewhere only a subclass that records its own graphs (the tests')
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.captured: dict[int, _Captured] = {}
        self.made: dict[int, tuple[weakref.ref, _Tensor]] = {}  # id(tensor) -> (the tensor, its place): this step
        self.clones: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # capture step: id(user's tensor) -> clone
        self.fed: dict[int, tuple[weakref.ref, int]] = {}  # id(held) -> (what was last copied in, its _version)
        self.fed_now: dict[int, int] = {}  # id(held) -> id(what this step copied in)
        self.retired: list[dict[int, _Captured]] = []  # graphs given up; freed at the next step's end

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        return self.state == "capture"

    @property
    def active(self) -> bool:
        """Capturing or replaying: accumulators are the executor's own and get copied out at the step's end."""
        return self.state in ("capture", "replay")

    def begin_step(self) -> None:
        self.made, self.fed_now = {}, {}
        if self.state == "warm" and self.warmed:
            self.state = "capture"

    def end_step(self, ok: bool) -> None:
        self.made, self.fed_now = {}, {}
        if self.state == "warm":
            self.warmed = self.warmed or ok
        elif self.state == "capture":
            if ok:
                self.state = "replay"
                self.clones = {}
                log.info("CUDA graphs: %d compute instructions captured", len(self.captured))
            else:
                self.off("the step that captured them failed")
        elif ok and self.retired:  # nothing of this step reads them any more once the device is done
            torch.cuda.synchronize(self.device)
            self.retired = []

    def off(self, why: str) -> None:
        if self.state != "off":
            log.warning("CUDA graphs off for this step and every later one: %s", why)
        self.state = "off"
        if self.captured:
            self.retired.append(self.captured)
        self.captured, self.clones, self.fed = {}, {}, {}

    # -- one instruction --------------------------------------------------------------------------------------
    def run(self, key: int, program: Any, fn: Callable[..., Any], args: Sequence[Any],
            foreign: Collection[int] = ()) -> Any:
        """`fn(*args)` for compute instruction `key` (id of the instruction) of program `program` (its (stage,
        kind, accumulate), for messages); `foreign`: positions of `args` that are the user's tensors (never
        written: the capture reads clones of them)."""
        if self.state == "replay":
            found = self.captured.get(key)
            if found is not None:
                try:
                    return self._replay(found, args)
                except Exception as e:  # noqa: BLE001 -- anything the graph cannot take: run eagerly from here on
                    self.off(f"replaying program {program}: {type(e).__name__}: {e}")
        elif self.state == "capture":
            try:
                return self._capture(key, fn, args, foreign)
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

    def _capture(self, key: int, fn: Callable[..., Any], args: Sequence[Any], foreign: Collection[int]) -> Any:
        inputs = [None if not isinstance(a, torch.Tensor) else self._classify(a, k in foreign)
                  for k, a in enumerate(args)]
        reads = [a if slot is None else slot.held if slot.held is not None else a for a, slot in zip(args, inputs)]
        graph, outs = self.record(fn, reads)
        single = not isinstance(outs, (tuple, list))
        flat = [outs] if single else list(outs)
        places = [_Tensor.of(t) if isinstance(t, torch.Tensor) else None for t in flat]
        self.captured[key] = _Captured(graph, inputs, places, single)
        graph.replay()  # on the step's stream: this step's values (a capture runs nothing)
        for t, place in zip(flat, places):  # a view of an input too: every input stays where the capture read it
            if place is not None:
                self.made[id(t)] = (weakref.ref(t), place)
        return outs

    def _classify(self, t: torch.Tensor, foreign: bool) -> _Input:
        entry = self.made.get(id(t))
        if entry is not None and entry[0]() is t:
            return _Input(made=entry[1])
        if not foreign:
            return _Input(held=t)
        found = self.clones.get(id(t))
        if found is not None and found[0]() is t:
            return _Input(held=found[1])
        clone = t.clone()
        if not _same_layout(clone, t):
            raise Mismatch(f"an input of strides {tuple(t.stride())} (overlapping or not dense) cannot be cloned "
                           "as it is")
        self.clones[id(t)] = (weakref.ref(t), clone)
        self.fed[id(clone)] = (weakref.ref(t), t._version)
        return _Input(held=clone)

    def _replay(self, found: _Captured, args: Sequence[Any]) -> Any:
        if len(args) != len(found.inputs):
            raise Mismatch(f"{len(args)} arguments where the graph took {len(found.inputs)}")
        for a, slot in zip(args, found.inputs):
            if slot is None:
                continue
            if slot.made is not None:
                if not slot.made.at(a):
                    raise Mismatch("an input made by an earlier graph is not where the capture had it")
                continue
            self._feed(slot.held, a)
        found.graph.replay()
        outs = [None if p is None else p.rebuild(self.device) for p in found.outputs]
        for t, place in zip(outs, found.outputs):
            if place is not None:
                self.made[id(t)] = (weakref.ref(t), place)
        return outs[0] if found.single else tuple(outs)

    def _feed(self, held: torch.Tensor, a: torch.Tensor) -> None:
        """Bring `a`'s values into `held` unless they are there already (`a` is it, or was copied in and not
        changed since)."""
        if a is held or (a.data_ptr() == held.data_ptr() and _same_layout(a, held)):
            return
        if not _same_layout(a, held):
            raise Mismatch(f"an input of shape {tuple(a.shape)}, strides {tuple(a.stride())}, {a.dtype} where the "
                           f"capture had {tuple(held.shape)}, {tuple(held.stride())}, {held.dtype}")
        now = self.fed_now.get(id(held))
        if now is not None and now != id(a):
            raise Mismatch("two tensors for one input the capture read once")
        last = self.fed.get(id(held))
        if not (last is not None and last[0]() is a and last[1] == a._version):
            held.copy_(a)
            self.fed[id(held)] = (weakref.ref(a), a._version)
        self.fed_now[id(held)] = id(a)

    def close(self) -> None:
        self.captured, self.retired, self.made, self.clones, self.fed = {}, [], {}, {}, {}
        self.state = "off"


def pool_bytes(graphs: Graphs | None) -> int:
    """Bytes the graphs' pool holds on the device (its segments), 0 without graphs."""
    if graphs is None or graphs.pool is None or not (graphs.captured or graphs.retired):
        return 0
    pool = tuple(graphs.pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) == pool)
