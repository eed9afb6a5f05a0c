"""Region scales: the calibration's program scale measured on spans of the model as well as on the whole.

One program scale for the whole model misjudges a stage whose ops fuse (or overlap, or miss the cache) better or
worse than the model's average: ResNet-101x4 cut in two on 2 x H100 (inductor, 2026-11-26) ran its first
stage's forward 1.18 x the plan and the second's 0.81 x, and the planner predicted the step 1.17 x fast. So
calibration also cuts the model into REGIONS spans of about equal calibrated forward time, runs each span's
forward and fused backward program as the runtime will (compiled by the same compiler, at the same recompute
level as the whole-model scale, the real params and microbatch flowing from span to span), and keeps each
span's seconds over its ops' calibrated sum, divided by the whole model's scale. The result is a
`MeasuredScale` over the model graph's equations (`engine.planning.measured`): the cost model applies it to
every plan of that graph, before any stage program exists, and a rebalance multiplies the stage programs' own
ratios on top (`combined`).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

import ir

from .artifacts import autodiff
from .calibration import Calibration, ProgramCompiler, ProgramScale, calibrate, ops_sums, program_seconds, signature
from .measured import MeasuredScale, Span

log = logging.getLogger("engine.calibrate")
REGIONS = 4  # spans a model is timed in: each costs a compile of its forward and backward programs on rank 0


def region_cuts(times: Sequence[float], regions: int = REGIONS) -> list[int]:
    """Cut points (equation indices, strictly inside the graph) splitting equations of forward `times` into at
    most `regions` spans of about equal time; fewer where the graph has fewer equations than that."""
    total = sum(times)
    if total <= 0 or regions < 2 or len(times) < 2:
        return []
    cuts: list[int] = []
    done = 0.0
    for i, t in enumerate(times):
        if len(cuts) == regions - 1:
            break
        if i > 0 and done >= total * (len(cuts) + 1) / regions and (not cuts or i > cuts[-1]):
            cuts.append(i)
        done += t
    return cuts


def region_scale(g: ir.Graph, device: torch.device, cal: Calibration, inputs: Sequence[torch.Tensor],
                 whole: ProgramScale, *, level: bool | str = False, repeats: int = 3,
                 compile_program: ProgramCompiler = ir.compile_graph,
                 regions: int = REGIONS) -> tuple[MeasuredScale | None, Calibration]:
    """Each region's (`region_cuts` of `g`'s calibrated forward times) measured over planned forward and
    backward seconds, relative to `whole` (the whole model's scale for this compiler), and the table with the
    ops a region's programs have and the whole model's lack timed too (a cut makes them: the input grad of a
    region's first convolution, which the model's first one does not compute). None when the model is too small
    to cut, a region's program cannot run here (logged), or some op of it cannot be timed alone."""
    times = [cal.times.get(signature(e), 0.0) for e in g.eqns]
    cuts = region_cuts(times, regions)
    if not cuts or len(inputs) != len(g.inputs):
        return None, cal
    values: dict[int, torch.Tensor] = {}  # crossing value id -> its tensor, from the region before
    spans = []
    try:
        for stage in ir.split(g, cuts):
            ad = autodiff(stage, level, device=str(device))
            for part in (ad.forward, ad.backward):
                cal = calibrate(part.graph, device, calibration=cal)
            sums = ops_sums(ad, stage.graph, cal)
            if sums is None:
                log.warning("region scales not measured: some ops of equations %d:%d could not be timed alone",
                            stage.start, stage.stop)
                return None, cal
            ins = [inputs[i] for i in (*stage.param_ids, *stage.batch_ids)] + [values[v] for v in stage.acts_in]
            f_run, b_run, outs = program_seconds(ad, device, ins, sums.accumulate, sums.param_grads, repeats,
                                                 compile_program)
            values.update(zip(stage.acts_out, outs))
            f = f_run / sums.forward / whole.forward if sums.forward > 0 and whole.forward > 0 else 1.0
            b = b_run / sums.backward / whole.backward if sums.backward > 0 and whole.backward > 0 else 1.0
            spans.append(Span(stage.start, stage.stop, f, b, b))
    except Exception as err:  # noqa: BLE001 -- e.g. out of memory: the whole model's scale stands alone
        log.warning("region scales not measured: %s: %s", type(err).__name__, err)
        return None, cal
    found = MeasuredScale(len(g.eqns), spans)
    log.info("calibration: regions run %s their ops' calibrated sum, over the whole model's scale", found)
    return found, cal

