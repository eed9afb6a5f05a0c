"""Calibration: measured seconds per op signature on the real device, cached in a dict or a JSON file.

Each distinct signature (op, input shapes and dtypes, constant arguments) runs once on random tensors
of its shapes (integers are zeros, so indices are valid); the median of a few runs is kept. A model of
N identical blocks measures one block's ops, not N. Then the model's whole forward and backward
programs run, WARM_ROUNDS rounds untimed and at least three timed, and the table keeps how much longer the
median round took than their ops' sum (`scale`): what ops timed alone miss, the gaps between launches and
operands no longer in cache.

Forward and backward programs get a scale each (`scale`, `backward_scale`): what ops timed alone miss differs
between them. Compiled programs (inductor) fuse ops, so their ops' sum says little about them: the same whole
programs are compiled and timed too (at the "cheap" recompute level, as the planner plans stages for a fusing
compiler), and `compiled[name]` / `compiled_backward[name]` keep their seconds over the ops' sum (below 1 where
fusion pays). `for_compiler(name)` is the table the planner costs that compiler's programs with: every
op's time scaled by it, so stages are balanced as they run. One factor for the whole model would mispredict a
stage whose ops fuse better or worse than the model's average, so each compiler's programs are also timed in a
few spans of the model (`regions`, `engine.planning.regions`), which the cost model applies on top.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

import ir
from ir.device import rank_neutral

from ..errors import PlanError
from .measured import MeasuredScale, Span

log = logging.getLogger("engine.calibrate")
ProgramCompiler = Callable[[ir.Graph, tuple[int, ...]], Callable[..., Any]]  # (graph, accumulate) -> runnable
WARM_ROUNDS = 2  # untimed rounds before the programs are timed (compiles, first allocations). The median timed
# round is kept, not the mean: the first timed round starts on the device idled by the clock's sync and pays a
# launch-bound program's launches in full (ResNet-101x4's fx forward on an H100, 2026-11-26: 41.8 ms, then
# 26.4-27.7 ms; the mean planned every fx forward 1.5 x slow)


def _describe(x: Any) -> Any:
    if isinstance(x, ir.Var):
        return str(x.aval)
    if isinstance(x, torch.device):  # cuda:0 on one rank is cuda:1 on the next: same op, same time
        return x.type
    if isinstance(x, ir.Literal):
        return str(x)
    return repr(x)


def signature(e: ir.Eqn) -> str:
    """Structural hash of (op, input shapes and dtypes, constant args): equal ops share one timing."""
    args = pytree.tree_map(_describe, e.args)
    kwargs = [(k, pytree.tree_map(_describe, v)) for k, v in e.kwargs]
    return hashlib.sha1(rank_neutral(f"{e.op}|{args}|{kwargs}").encode()).hexdigest()[:20]


def accumulate_signature(aval: ir.AbstractValue) -> str:
    """Key of the runtime's `acc.add_(grad)` for a weight grad of this shape and dtype (not an equation of
    any graph: the compiled backward adds each weight grad into its accumulator as it is made)."""
    return hashlib.sha1(f"accumulate|{aval.shape}|{aval.dtype}".encode()).hexdigest()[:20]


@attrs.frozen
class ProgramScale:
    """Whole programs' measured seconds over their ops' calibrated sum: the forward's, and the backward's
    (fused B and W with the weight grads' accumulation). They differ: a ResNet's fx forward ran 0.85 x its
    ops' sum and its backward 1.16 x (2 x H200, 2026-11-26), so one factor for both misjudged every stage."""

    forward: float = 1.0
    backward: float = 1.0
    launch: tuple[float, float] | None = None  # the host's launch from an idle device over the run, forward's
    # and backward's (CUDA; `Calibration.launches`)


REGIONS_FORMAT = 7  # 2: B's and W's ratios measured apart (`timed._split_shares`), tables before it had one;
# 3: the whole backward's ratio beside them (`measured.Span.backward`); 4: B's and W's ratios from their own
# programs' seconds, not shares of the fused backward's (`timed._split_shares`); 5: each region's ratios spread
# over the kinds of block it holds (`engine.planning.pieces`); 6: a piece of a kind of its own timed too (a head);
# 7: a kind without a pass's ratio keeps the region's there, the others spread among themselves (`pieces.spread`)


@attrs.frozen
class Calibration:
    """Measured seconds by op signature, for one device; `scale` is how much longer whole forward programs
    run than the sum of their ops timed alone, `backward_scale` the same for backward programs (measured by
    `program_scale`; 1 until then; None in older tables: `scale`)."""

    device: str
    times: Mapping[str, float] = attrs.field(factory=dict, converter=dict)
    scale: float = 1.0
    compiled: Mapping[str, float] = attrs.field(factory=dict, converter=dict)  # compiler -> its forwards' scale
    backward_scale: float | None = None
    compiled_backward: Mapping[str, float] = attrs.field(factory=dict, converter=dict)  # and its backwards'
    # compiler -> its programs' scale per span of the model over the whole model's (engine.planning.regions)
    regions: Mapping[str, MeasuredScale] = attrs.field(factory=dict, converter=dict)
    selected: str = "fx"  # the compiler `for_compiler` chose, whose region scales `region` gives
    # program digests of the microbatch graphs every op of whose training step is timed here (`calibrate_training`)
    covered: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # compiler -> the host's seconds to launch its whole forward / backward program from an idle device over the
    # program's seconds (CUDA only; measured with the program scales, so a table from before has none and its
    # plans model no host): a ratio near 1 or above is a launch-bound program (`launch`)
    launches: Mapping[str, tuple[float, float]] = attrs.field(factory=dict, converter=dict)

    @property
    def region(self) -> MeasuredScale | None:
        """The selected compiler's region scales (None if not measured)."""
        return self.regions.get(self.selected)

    @property
    def launch(self) -> tuple[float, float] | None:
        """The selected compiler's launch ratios, forward's and backward's (None if not measured): the planner's
        host issues a stage's programs in these shares of their times (`stage_costs.schedule_costs`)."""
        return self.launches.get(self.selected)

    @property
    def backward_ratio(self) -> float:
        """backward_scale / scale: what a backward op's scaled time is multiplied by beyond a forward op's."""
        return 1.0 if self.backward_scale is None or self.scale <= 0 else self.backward_scale / self.scale

    def with_scale(self, found: ProgramScale) -> Calibration:
        launches = {k: v for k, v in self.launches.items() if k != "fx"}  # an older ratio is not this scale's
        if found.launch is not None:
            launches["fx"] = found.launch
        return attrs.evolve(self, scale=found.forward, backward_scale=found.backward, launches=launches)

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "times": dict(sorted(self.times.items())), "scale": self.scale,
                           "compiled": dict(sorted(self.compiled.items())), "backward_scale": self.backward_scale,
                           "compiled_backward": dict(sorted(self.compiled_backward.items())),
                           "regions": {k: [r.num_eqns, [attrs.astuple(x) for x in r.spans], r.batch, REGIONS_FORMAT]
                                       for k, r in sorted(self.regions.items())},
                           "covered": sorted(self.covered),
                           "launches": {k: list(v) for k, v in sorted(self.launches.items())}})

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        d = json.loads(text)
        back = d.get("backward_scale")
        return cls(d["device"], {k: float(v) for k, v in d["times"].items()}, float(d.get("scale", 1.0)),
                   {k: float(v) for k, v in d.get("compiled", {}).items()}, None if back is None else float(back),
                   {k: float(v) for k, v in d.get("compiled_backward", {}).items()},
                   {k: MeasuredScale(int(r[0]), [Span(*x) for x in r[1]], r[2])  # a scale without its graph's
                    for k, r in d.get("regions", {}).items()  # key, or of an older format: measured again
                    if len(r) == 4 and r[2] and r[3] == REGIONS_FORMAT},
                   covered=tuple(d.get("covered", ())),
                   launches={k: (float(v[0]), float(v[1])) for k, v in d.get("launches", {}).items()})

    def for_compiler(self, name: str) -> Calibration:
        """The table as programs compiled by `name` run: its measured scales in place of fx's ("fx", or a
        compiler not measured yet: the table as it is, logged), and its region scales (`region`). Called on the
        table as calibrated (fx's scales in `scale`)."""
        if name != "fx" and name not in self.compiled:
            log.warning("no %s programs were timed in this calibration: costing them as fx programs", name)
            name = "fx"
        if name == "fx":
            return self if self.selected == "fx" else attrs.evolve(self, selected="fx")
        return attrs.evolve(self, scale=self.compiled[name], backward_scale=self.compiled_backward.get(name),
                            selected=name)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_json(Path(path).read_text())


def _random_input(v: ir.Var, device: torch.device) -> torch.Tensor:
    aval = v.aval
    if aval.dtype.is_floating_point or aval.dtype.is_complex:
        return torch.randn(aval.shape, dtype=aval.dtype, device=device)
    if aval.dtype == torch.bool:
        return torch.ones(aval.shape, dtype=aval.dtype, device=device)
    return torch.zeros(aval.shape, dtype=aval.dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eqn(g: ir.Graph, index: int, device: torch.device, *, repeats: int = 5) -> float:
    """Seconds of equation `index` of `g` on `device`, on random inputs of its shapes, as the runtime
    runs it: compiled, launched back to back with no sync in between (a stage program syncs only at its
    transfers), so a small op costs its launch, not a launch plus a round trip to the device. The median
    of three batches of `repeats` runs, each divided by `repeats`."""
    sub = ir.slice_graph(g, [index])
    fn = ir.compile_graph(sub)
    inputs = [_random_input(v, device) for v in sub.inputs]
    return _seconds(lambda: fn(*inputs), device, repeats)


def _seconds(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Seconds per call of `run`: once to warm up (first-call allocation and kernel selection), then the
    median of three batches of `repeats` calls back to back, each divided by `repeats`."""
    run()
    batches = []
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        _sync(device)
        batches.append((time.perf_counter() - start) / repeats)
    return statistics.median(batches)


def _costly(e: ir.Eqn) -> bool:
    """Whether an equation costs anything (views and other metadata-only ops are free, not timed)."""
    cost = ir.eqn_cost(e)
    return bool(cost.flops or cost.bytes)


def calibrate(g: ir.Graph, device: str | torch.device = "cuda", *, repeats: int = 5,
              calibration: Calibration | None = None) -> Calibration:
    """Time every op signature of `g` not yet in `calibration` once on `device`; returns the merged table.
    An op that cannot run on random inputs keeps its roofline estimate (logged at debug level)."""
    dev = torch.device(device)
    times = dict(calibration.times) if calibration is not None else {}
    for i, e in enumerate(g.eqns):
        key = signature(e)
        if key in times or not _costly(e):
            continue
        try:
            times[key] = time_eqn(g, i, dev, repeats=repeats)
        except RuntimeError as err:
            log.debug("not calibrated: %s on random inputs failed: %s", e.op, err)
    if calibration is None:
        return Calibration(str(dev), times)
    return attrs.evolve(calibration, times=times)


def time_accumulate(aval: ir.AbstractValue, device: torch.device, *, repeats: int = 5) -> float:
    """Seconds of `acc.add_(grad)` for a weight grad of `aval`, timed as `time_eqn` times an equation."""
    acc, grad = (_random_input(ir.Var(aval), device) for _ in range(2))
    return _seconds(lambda: acc.add_(grad), device, repeats)


def calibrate_training(g: ir.Graph, device: str | torch.device = "cuda", *, repeats: int = 5,
                       calibration: Calibration | None = None, inputs: Sequence[torch.Tensor] | None = None,
                       compile_program: ProgramCompiler = ir.compile_graph,
                       compiled: Mapping[str, ProgramCompiler] | None = None) -> Calibration:
    """Calibrate every op a training step of model graph `g` runs: its own equations (what the splitter
    estimates from), the forward, B and W graphs that stage autodiff makes of it, and each weight grad's
    accumulation. Given the step's real `inputs` (params then one microbatch, as `g.inputs`), also the
    scale of whole programs over their ops (`program_scale`), measured again whenever ops were timed (a
    new microbatch size: the latest measurement holds for the table); otherwise the table's scale stands.
    `compile_program(graph, accumulate)` is how the runtime makes a program runnable (the execution
    side's compiler, handed in: planning does not import execution); `compiled` names other compilers
    whose programs' scale is measured too (`Calibration.compiled`; again only when ops were timed). The
    scales per span of the model come after, from `engine.planning.regions.with_regions`. A table that already
    covers `g` (its digest in `covered`: every op timed) with every scale asked for is returned as it is, without
    differentiating the model (seconds of a warm restart)."""
    digest = ir.program_digest(g)
    if calibration is not None and _complete(calibration, digest, inputs is not None, compiled or {}):
        return calibration
    dev = torch.device(device)
    joints: dict[Any, ir.Graph] = {}  # the model's joint, traced once for both recompute levels
    ad = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs)), device=str(dev),
                           constant_outputs=range(1, len(g.outputs)), joints=joints)  # aux: not differentiated
    cal = calibrate(g, dev, repeats=repeats, calibration=calibration)
    for part in (ad.forward, ad.backward_input, ad.backward_weight):
        cal = calibrate(part.graph, dev, repeats=repeats, calibration=cal)
    times = dict(cal.times)
    for v in g.params:
        key = accumulate_signature(v.aval)
        if key not in times and v.aval.dtype.is_floating_point:
            times[key] = time_accumulate(v.aval, dev, repeats=repeats)
    cal = attrs.evolve(cal, times=times)
    fresh = calibration is None or cal.times != calibration.times
    if inputs is None:
        return attrs.evolve(cal, covered=sorted({*cal.covered, digest}))  # nothing real to run: the scales stand
    if fresh or calibration.scale == 1.0 or calibration.backward_scale is None:
        cal = cal.with_scale(program_scale(ad, g, dev, cal, inputs, repeats=repeats, compile_program=compile_program))
    scales = {} if fresh else dict(cal.compiled)
    backs = {} if fresh else dict(cal.compiled_backward)
    launches = {k: v for k, v in cal.launches.items() if k == "fx" or not fresh}
    if any(name not in backs for name in compiled or {}):  # a fusing compiler's stages run the cheap level
        fused = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs)), device=str(dev),
                                  constant_outputs=range(1, len(g.outputs)), recompute="cheap", joints=joints)
    for name, compiler in (compiled or {}).items():
        if name not in backs:
            found = program_scale(fused, g, dev, cal, inputs, repeats=repeats, compile_program=compiler)
            scales[name], backs[name] = found.forward, found.backward
            if found.launch is not None:
                launches[name] = found.launch
            log.info("calibration: %s programs run %.3f x (forward) and %.3f x (backward) their ops' calibrated sum",
                     name, found.forward, found.backward)
    return attrs.evolve(cal, compiled=scales, compiled_backward=backs, covered=sorted({*cal.covered, digest}),
                        launches=launches)


def _launch_bound_device(device: torch.device) -> bool:
    """Whether programs on `device` are launched by a host that runs ahead of it (CUDA), so that a launch time
    apart from the run's is measured (`ProgramScale.launch`)."""
    return device.type == "cuda"


def _complete(table: Calibration, digest: str, scaled: bool, compiled: Mapping[str, Any]) -> bool:
    """Whether `table` times every op of the graph of `digest` and (`scaled`: the caller has real inputs) holds the
    whole programs' scales, fx's and each of `compiled`'s: `calibrate_training` would add nothing to it."""
    if digest not in table.covered:
        return False
    return not scaled or (table.scale != 1.0 and table.backward_scale is not None
                          and all(name in table.compiled_backward for name in compiled))


def program_scale(ad: ir.StageAD, g: ir.Graph, device: torch.device, cal: Calibration,
                  inputs: Sequence[torch.Tensor], *, repeats: int = 5,
                  compile_program: ProgramCompiler = ir.compile_graph) -> ProgramScale:
    """Measured seconds of model `g`'s forward and of its fused backward program (`ad`) on the step's real
    params and microbatch (`inputs`), run as the runtime runs them (compiled, one after the other, weight
    grads added into accumulators), each over its calibrated ops' (and accumulations') sum. Ops timed alone,
    each on the same random inputs again and again, miss what a program pays between them (launch gaps,
    operands no longer in cache, the speed of real data); the cost model multiplies by these. 1.0 (logged)
    when the programs cannot run here (too large for one device) or some op could not be timed alone."""
    if len(inputs) != len(g.inputs):
        log.warning("program scale not measured: %d inputs for a graph of %d", len(inputs), len(g.inputs))
        return ProgramScale()
    sums = ops_sums(ad, g, cal)
    if sums.missing:  # their roofline times are not what the scale would correct
        log.warning("program scale not measured: %d of %d ops could not be timed alone", sums.missing, sums.ops)
        return ProgramScale()
    try:
        runs = program_seconds(ad, device, inputs, sums.accumulate, sums.param_grads, max(repeats, 3),
                               compile_program)
    except Exception as err:  # noqa: BLE001 -- e.g. out of memory: the op times are used as they are
        log.warning("program scale not measured (op times used as they are): %s: %s", type(err).__name__, err)
        return ProgramScale()
    f_run, b_run, f_sum, b_sum = runs.forward, runs.backward, sums.forward, sums.backward
    whole = (f_run + b_run) / (f_sum + b_sum) if f_sum + b_sum > 0 else 1.0
    launch = None if runs.launch is None or f_run <= 0 or b_run <= 0 else \
        (runs.launch[0] / f_run, runs.launch[1] / b_run)
    if launch is not None:
        log.info("calibration: the forward program launched from an idle device in %.2f x its run, the backward in "
                 "%.2f x", *launch)
    return ProgramScale(f_run / f_sum if f_sum > 0 else whole, b_run / b_sum if b_sum > 0 else whole, launch)


@attrs.frozen
class OpsSums:
    """A graph's programs (`ad`) as the calibration table costs them: the forward's timed ops summed, the fused
    backward's with each weight grad's accumulation, the backward outputs added into accumulators
    (`accumulate`), each param's grad slot (`param_grads`: slot -> input position), and how many of the `ops`
    (costly ops and accumulations) the table lacks (`missing`: then the sums say little)."""

    forward: float
    backward: float
    accumulate: tuple[int, ...]
    param_grads: dict[int, int]
    missing: int
    ops: int


def split_sums(ad: ir.StageAD, cal: Calibration, param_grads: dict[int, int], g: ir.Graph) -> tuple[float, float]:
    """B's program and W's as the calibration table costs them (W with its weight grads' accumulations): the
    sums a split backward's measured seconds are set against (`regions`)."""
    b = sum(cal.times.get(signature(e), 0.0) for e in ad.backward_input.graph.eqns if _costly(e))
    w = sum(cal.times.get(signature(e), 0.0) for e in ad.backward_weight.graph.eqns if _costly(e))
    w += sum(cal.times.get(accumulate_signature(g.inputs[param_grads[slot]].aval), 0.0)
             for slot in ad.backward_weight.out_slots if slot in param_grads)
    return b, w


def ops_sums(ad: ir.StageAD, g: ir.Graph, cal: Calibration) -> OpsSums:
    """`OpsSums` of `ad`, the stage autodiff of `g`."""
    fwd, bwd = ad.forward, ad.backward
    param_grads = {s: i for i, s in enumerate(ad.grad_slots[: g.num_params]) if s is not None}
    acc = tuple(k for k, slot in enumerate(bwd.out_slots) if slot in param_grads)
    f_keys = [signature(e) for e in fwd.graph.eqns if _costly(e)]
    b_keys = [signature(e) for e in bwd.graph.eqns if _costly(e)]
    b_keys += [accumulate_signature(g.inputs[param_grads[bwd.out_slots[k]]].aval) for k in acc]
    missing = sum(k not in cal.times for k in (*f_keys, *b_keys))
    return OpsSums(sum(cal.times.get(k, 0.0) for k in f_keys), sum(cal.times.get(k, 0.0) for k in b_keys), acc,
                   param_grads, missing, len(f_keys) + len(b_keys))


SETTLE = "FNPIPE_PROFILE_SETTLE"


def settle_seconds(device: torch.device) -> float:
    """Seconds of untimed runs right before programs are timed, here (`program_seconds`) and before the first
    stage's programs at start-up (`Executor.measure`) (`FNPIPE_PROFILE_SETTLE`; default SETTLE_CUDA on CUDA,
    0 elsewhere). A GPU held at its power cap runs a sustained load at a lower clock than a
    short burst from idle gets: one H100 ran GPT's one-GPU step at a median 1,710 MHz, power-capped on every
    busy sample (4 x H100, 2026-11-27, `h200_session.sh fourpower`), while a stage's programs timed in turn from
    idle are a 10-30 ms burst. A step is a sustained load, so its programs are timed at the clock it holds: GPT's
    zbv at p = 4 ran 1.129 x its programs timed from idle, 1.074 x after 0.5 s of them and 1.047 x after 2 s
    (4 x H100, `h200_session.sh foursettle`).
    A value that is not a number >= 0 raises PlanError (`engine.init` asks first, on every rank)."""
    text = os.environ.get(SETTLE, "").strip()
    if not text:
        return SETTLE_CUDA if device.type == "cuda" else 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise PlanError(f"{SETTLE}={text!r}: give the seconds a stage's programs run before they are timed, a "
                        f"number >= 0 (e.g. {SETTLE_CUDA}; 0 times them from an idle device)")
    return value


SETTLE_CUDA = 1.0


def settling_rounds(seconds: float, round_: Callable[[], Any], clock: Clock, most: int = 10_000) -> int:
    """Run `round_` once, timed, and give how many more rounds take about `seconds` (0 for no settling, else at
    least one, at most `most`)."""
    if seconds <= 0:
        return 0
    clock.start()
    clock.mark()
    round_()
    clock.mark()
    one = sum(clock.gaps())
    return max(1, min(most, math.ceil(seconds / one))) if one > 0 else 0  # a round of no time: nothing to settle


@attrs.frozen
class ProgramRuns:
    """`program_seconds`' medians: the forward program, the fused backward, and with `split` the backward
    split as zero-bubble schedules run it, B's program then W's (None otherwise); the forward's outputs."""

    forward: float
    backward: float
    outs: list[torch.Tensor] = attrs.field(eq=False, repr=False)
    backward_input: float | None = None
    backward_weight: float | None = None
    launch: tuple[float, float] | None = None  # the forward's and fused backward's launch from an idle device (CUDA)


def program_seconds(ad: ir.StageAD, device: torch.device, inputs: Sequence[torch.Tensor], acc: tuple[int, ...],
                    param_grads: dict[int, int], repeats: int, compile_program: ProgramCompiler, *,
                    split: bool = False) -> ProgramRuns:
    """Seconds a run of the forward and of the fused backward program (with `split`, also of B's program and
    then W's, on the same forward's values), one after the other `repeats` times after WARM_ROUNDS untimed
    rounds and `settle_seconds` more, each timed on its own (CUDA events, or the host clock on CPU); the median
    round of each (program_scale asks for at least three); and the forward's outputs (`ad.out_slots`)."""
    programs = Programs(ad, device, inputs, acc, param_grads, compile_program, split=split)
    return attrs.evolve(programs.timed(repeats), launch=programs.launched(repeats))


class Programs:
    """A stage's forward and fused backward programs (with `split`, B's and W's too), compiled, with their
    values on the device, ready to be timed (`timed`), once or again later."""

    def __init__(self, ad: ir.StageAD, device: torch.device, inputs: Sequence[torch.Tensor], acc: tuple[int, ...],
                 param_grads: dict[int, int], compile_program: ProgramCompiler, *, split: bool = False,
                 queued: bool = False) -> None:
        self.ad, self.device, self.split, self.queued = ad, device, split, queued
        fwd, bwd = ad.forward, ad.backward
        self.slots = {i: _random_input(ir.Var(a), device) for i, a in enumerate(ad.slot_avals) if a is not None}
        self.slots.update((i, x.to(device)) for i, x in enumerate(inputs))
        self.run_f = compile_program(fwd.graph, ())
        accs = [torch.zeros_like(self.slots[param_grads[bwd.out_slots[k]]]) for k in acc]
        self.parts = [(compile_program(bwd.graph, acc), bwd, accs)]
        if split:  # as the runtime runs them: W adds its weight grads into the accumulators, B adds none (a grad
            # B makes, a norm's weight's, is one of W's inputs: `emit._backward`)
            for part in (ad.backward_input, ad.backward_weight):
                summed = tuple(k for k, slot in enumerate(part.out_slots)
                               if slot in param_grads and part is ad.backward_weight)
                self.parts.append((compile_program(part.graph, summed), part,
                                   [torch.zeros_like(self.slots[param_grads[part.out_slots[k]]]) for k in summed]))
        self.clock = Clock(device)

    def once(self, timed: bool) -> None:
        slots, fwd = self.slots, self.ad.forward
        if timed:
            self.clock.mark()
        slots.update(zip(fwd.out_slots, self.run_f(*[slots[i] for i in fwd.in_slots])))
        for run, part, sums in self.parts:
            if timed:
                self.clock.mark()
            slots.update(zip(part.out_slots, run(*[slots[i] for i in part.in_slots], *sums)))

    def timed(self, repeats: int) -> ProgramRuns:
        """The medians of `repeats` timed rounds, after WARM_ROUNDS untimed ones and `settle_seconds` more; on CUDA,
        with `queued` (small programs: a block's piece) always behind a spin of the device (`_queued`), else again
        behind one where a warm round's launches (issued to an idle device) take HOST_BOUND of the rounds' timed
        seconds: what the planner costs is the device's work (the host's launches are costed apart,
        `Calibration.launches`), and a round its launches pace times the host, which other processes slow."""
        clock = self.clock
        host = 0.0
        for _ in range(WARM_ROUNDS):
            _sync(self.device)
            start = time.perf_counter()
            self.once(False)
            host = time.perf_counter() - start  # issued to an idle device: the launches alone (on CUDA)
        settling = settling_rounds(settle_seconds(self.device), lambda: self.once(False), clock)
        if self.queued and self.device.type == "cuda":
            gaps = self._queued(settling, repeats, host)
        else:
            gaps, _ = self._rounds(settling, repeats, 0.0)
            if self.device.type == "cuda" and host * repeats >= HOST_BOUND * sum(gaps):  # launches paced them
                log.info("calibration: programs timed at their launches' pace (%.2f ms to launch a round, %.2f ms "
                         "a round timed): timed again behind a spin of the device", host * 1e3,
                         sum(gaps) / repeats * 1e3)
                gaps = self._queued(settling, repeats, host)
        every = 1 + len(self.parts)
        medians = [statistics.median(gaps[k::every]) for k in range(every)]
        log.info("calibration: forward program %s ms, backward %s ms%s (each round; the medians are kept)",
                 _ms(gaps[0::every]), _ms(gaps[1::every]),
                 f", B {_ms(gaps[2::every])} ms, W {_ms(gaps[3::every])} ms" if self.split else "")
        return ProgramRuns(medians[0], medians[1], [self.slots[i] for i in self.ad.out_slots], *medians[2:])

    def _queued(self, settling: int, repeats: int, host: float) -> list[float]:
        """Timed rounds queued up behind a spin of the device 1.25 x as long as `host` (a round's launches) times
        `repeats`; again behind a longer one where the host took longer than the spin to issue them."""
        spin = 1.25 * host * repeats + 1e-3
        gaps, issued = self._rounds(settling, repeats, spin)
        if issued > spin:
            log.info("calibration: the timed rounds took %.2f ms to issue, longer than the %.2f ms spin ahead of "
                     "them: timed again behind a longer one", issued * 1e3, spin * 1e3)
            gaps, issued = self._rounds(settling, repeats, 1.5 * issued + 1e-3)
        return gaps

    def _rounds(self, settling: int, repeats: int, spin: float) -> tuple[list[float], float]:
        """`settling` untimed rounds and then `repeats` timed ones: the programs' seconds (forward, backward[, B,
        W], forward, ...) and the host's seconds to issue the timed rounds. No sync between them, or with `spin` > 0
        one sync and then the device spinning that long (`spin_device`), so the timed rounds queue up behind it and
        run at the device's pace (the sync leaves it idle for one launch; the settling rounds' backlog would
        hold the host past the spin)."""
        clock = self.clock
        clock.start()  # before the settling rounds: no sync between them and the timed ones
        for _ in range(settling):
            self.once(False)
        if spin > 0:
            _sync(self.device)
            spin_device(self.device, spin)
        start = time.perf_counter()
        for _ in range(repeats):
            self.once(True)
        clock.mark()
        issued = time.perf_counter() - start
        return clock.gaps(), issued

    def launched(self, repeats: int) -> tuple[float, float] | None:
        """The host's seconds to launch the forward and then the fused backward from an idle device (the median of
        `repeats`, each after a sync); None off CUDA (`_launch_bound_device`)."""
        if not _launch_bound_device(self.device):
            return None
        slots, fwd = self.slots, self.ad.forward
        run_b, bwd, sums = self.parts[0]
        forward, backward = [], []
        for _ in range(max(1, repeats)):
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            outs = self.run_f(*[slots[i] for i in fwd.in_slots])
            forward.append(time.perf_counter() - start)
            slots.update(zip(fwd.out_slots, outs))
            del outs
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            outs = run_b(*[slots[i] for i in bwd.in_slots], *sums)
            backward.append(time.perf_counter() - start)
            slots.update(zip(bwd.out_slots, outs))
            del outs
        torch.cuda.synchronize(self.device)
        return statistics.median(forward), statistics.median(backward)


def _ms(seconds: Sequence[float]) -> str:
    return "/".join(f"{t * 1e3:.2f}" for t in seconds)


HOST_BOUND = 0.8  # timed rounds whose launches took this share of their device time or more were paced by the
# host: a Llama attention piece alone (0.25 ms of kernels) timed 0.25 ms in one launch and 0.52-0.79 ms in the
# next, beside other ranks' compiles (4 x H100, session 26); behind a spin they run at the device's pace


def spin_device(device: torch.device, seconds: float) -> None:
    """Keep a CUDA device busy about `seconds` (`torch.cuda._sleep`, its cycles per second measured once), so
    the work launched next queues up behind it; nothing elsewhere or for 0 seconds."""
    if device.type != "cuda" or seconds <= 0:
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    with torch.cuda.device(index):
        torch.cuda._sleep(max(1, int(seconds * _cycles_per_second(index))))


_CYCLES: dict[int, float] = {}


def _cycles_per_second(index: int) -> float:
    if index not in _CYCLES:
        with torch.cuda.device(index):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)  # a first launch pays its own setup
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            _CYCLES[index] = 10_000_000 / max(start.elapsed_time(end) / 1e3, 1e-6)
    return _CYCLES[index]


class Clock:
    """Marks in the order the device reaches them: CUDA events on the current stream (read after one sync
    at the end), the host clock elsewhere. `gaps()`: the seconds between consecutive marks."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.marks: list[Any] = []

    def start(self) -> None:
        self.marks = []
        _sync(self.device)

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def gaps(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]
