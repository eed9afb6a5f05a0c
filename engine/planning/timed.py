"""Stages timed at calibration: a few spans of the model (its regions) or pieces of it, each stage's programs
compiled as a plan's are and timed on the device, twice (the faster kept), against its ops' calibrated sums.

`engine.planning.regions` times the model in spans of about equal time and `engine.planning.pieces` one piece of
each kind of block; both read each stage's run (`timed_stages`) as ratios to its ops' sums.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

import ir

from .artifacts import autodiff
from .calibration import Calibration, ProgramCompiler, ProgramRuns, Programs, calibrate, ops_sums, split_sums

log = logging.getLogger("engine.calibrate")


Feed = Callable[[ir.Stage, Mapping[int, torch.Tensor]], Sequence[torch.Tensor]]


def timed_stages(stages: Sequence[ir.Stage], device: torch.device, cal: Calibration, feed: Feed, *,
                 level: bool | str, repeats: int, compile_program: ProgramCompiler, what: str,
                 queued: bool = False) -> tuple[list[tuple[Any, ...]] | None, Calibration]:
    """Each of `stages` (of one microbatch graph) autodiffed at `level`, its forward, fused backward, B and W
    programs compiled and timed on `device` (each program's faster of a timing right after its compile and one once
    all are compiled: `_again`), as a run (start, stop, forward ops' sum, backward ops' sum, forward seconds,
    backward seconds, B's and W's factors on the backward's ratio: `_split_shares`, both None where B and W were not
    timed apart); and `cal` with the ops only these programs have timed (`queued`: `calibration.Programs`'s). A
    stage's inputs are `feed(stage, values)`, `values` the outputs of the stages before (by value id; inputs left
    out are random, `calibration.Programs`). None when some op cannot be timed alone or a program cannot run here
    (logged with `what`: out of memory, a compiler's failure)."""
    values: dict[int, torch.Tensor] = {}  # crossing value id -> its tensor, from the stage before
    measured = []  # per stage: (its stage, its ops' sums, its programs' seconds, its programs while held)
    for stage in stages:
        ad = autodiff(stage, level, device=str(device))  # as a plan's stage's programs are made
        for part in (ad.forward, ad.backward, ad.backward_input, ad.backward_weight):
            cal = calibrate(part.graph, device, calibration=cal)
        sums = ops_sums(ad, stage.graph, cal)
        if sums.missing:
            log.warning("%s not measured: %d of %d ops of equations %d:%d could not be timed alone",
                        what, sums.missing, sums.ops, stage.start, stage.stop)
            return None, cal
        try:
            ran, programs = _held_timed(ad, device, list(feed(stage, values)), sums.accumulate, sums.param_grads,
                                        repeats, compile_program, measured, what, queued)
        except RuntimeError as err:  # out of memory, a compiler's failure: the whole model's scale stands alone
            log.warning("%s not measured (equations %d:%d): %s: %s", what, stage.start, stage.stop,
                        type(err).__name__, err)
            return None, cal
        values.update(zip(stage.acts_out, ran.outs))
        measured.append((stage, ad, sums, ran, programs))
        del programs  # held in `measured` alone: letting go there frees it
    runs = []
    for (stage, ad, sums, first, _), again in zip(measured, _again([m[4] for m in measured], repeats, what)):
        ran = _faster(first, again)
        shares = _split_shares(ran, sums.backward, *split_sums(ad, cal, sums.param_grads, stage.graph))
        runs.append((stage.start, stage.stop, sums.forward, sums.backward, ran.forward, ran.backward,
                     *(shares if shares is not None else (None, None))))
    return runs, cal


def _held_timed(ad: ir.StageAD, device: torch.device, ins: Sequence[torch.Tensor], acc: tuple[int, ...],
                param_grads: dict[int, int], repeats: int, compile_program: ProgramCompiler,
                measured: list[tuple], what: str, queued: bool) -> tuple[ProgramRuns, Programs]:
    """A region's programs timed with its backward split as well, and the programs, held for their second
    timing (`_again`) beside the regions' before it. Where that leaves too little memory, the regions before are
    let go (each keeps its first timing) and it is tried again; where the split programs still cannot run (they
    hold a second set of weight grads and B's hand-over beside the fused backward's), the forward and fused
    backward alone, so the region keeps its scale with one ratio for B and W (both logged)."""
    def attempt(split: bool) -> tuple[ProgramRuns, Programs]:
        programs = Programs(ad, device, ins, acc, param_grads, compile_program, split=split, queued=queued)
        return programs.timed(repeats), programs

    try:
        return attempt(True)
    except RuntimeError as err:
        failed = err.with_traceback(None)  # its frames would hold the failed attempt's tensors
    if any(m[4] is not None for m in measured):
        log.warning("%s: timed once, holding them for a second timing leaves too little memory (%s: %s)",
                    what, type(failed).__name__, failed)
        measured[:] = [(*m[:4], None) for m in measured]
        _free(device)
        try:
            return attempt(True)
        except RuntimeError as err:
            failed = err.with_traceback(None)
    log.warning("%s: B and W not timed apart (one ratio for both): %s: %s", what, type(failed).__name__, failed)
    _free(device)
    return attempt(False)


def _again(held: Sequence[Programs | None], repeats: int, what: str) -> list[ProgramRuns | None]:
    """Every region's programs timed a second time, once all are compiled. The first timing of a region runs
    right after its compile, beside whatever the host still does (a compiler's workers, other ranks' compiles:
    a program whose launches outrun its kernels then runs slow), and one outlier skews the planner: a Llama's
    fourth to ninth blocks, alike, timed 0.94 x and 1.17 x the model's mean forward in two regions
    (4 x H100, 2026-11-27). All None where a region was let go or fails now: the regions are normalised against
    each other, so all keep their first timing rather than some the faster of two."""
    out: list[ProgramRuns | None] = []
    for programs in held:
        if programs is None:
            return [None] * len(held)
        try:
            out.append(programs.timed(repeats))
        except RuntimeError as err:
            log.warning("%s: a second timing failed (the first timings stand): %s: %s", what, type(err).__name__,
                        err)
            return [None] * len(held)
    return out


def _faster(first: ProgramRuns, again: ProgramRuns | None) -> ProgramRuns:
    """Each program's faster time of two timings (noise on a device only slows a program down)."""
    if again is None:
        return first

    def least(a: float | None, b: float | None) -> float | None:
        return a if b is None else b if a is None else min(a, b)

    return attrs.evolve(first, forward=min(first.forward, again.forward), backward=min(first.backward, again.backward),
                        backward_input=least(first.backward_input, again.backward_input),
                        backward_weight=least(first.backward_weight, again.backward_weight))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _split_shares(ran: ProgramRuns, fused_sum: float, b_sum: float, w_sum: float) -> tuple[float, float] | None:
    """Factors on a region's fused backward ratio that give B's and W's ops the seconds their own programs ran
    (`program_seconds(split=True)`), each a share of the fused backward's measured seconds: B's program over the
    fused one's, and W's. The whole model's calibrated ratio cannot tell B from W, and a compiler speeds them
    unevenly (a Llama's inductor-compiled block stages ran W 1.45-1.94 x and B 0.72-0.85 x what one ratio gave
    them, GPT's W 0.90-0.98 and B 0.96-1.06: 4 x H100, session 21's start-up measured scales); and apart they
    cost more than fused (a Llama's B + W 1.04-1.07 x its fused backward, 4 x H100, 2026-11-27), which a
    schedule that splits them pays while one that fuses them does not (it takes `Span.backward`). None where a
    part is empty (the first region's B: no input grads; a piece without weights' W) or was not measured."""
    b_run, w_run, fused_run = ran.backward_input, ran.backward_weight, ran.backward
    if b_run is None or w_run is None or min(b_run, w_run, fused_run, b_sum, w_sum, fused_sum) <= 0:
        return None
    return b_run / fused_run * fused_sum / b_sum, w_run / fused_run * fused_sum / w_sum
