"""Piece scales: each region's measured ratio spread over the kinds of block it holds, from one timed piece of each.

A region (`engine.planning.regions`) is a few blocks, and its one ratio costs every equation in it alike. The
splitter also cuts inside blocks, and there the op costs' own split of a block decides: a Llama block's attention
and MLP pieces cost 55 / 45 by their ops timed alone where its programs ran about 39 / 61 (4 x H100, inductor,
session 23), so at p = 4 a zbv stage of two blocks and an MLP piece ran 1.12 x its plan and its neighbour 0.90 x,
and the busiest rank carried 9.6 % over the mean (0.862 of ideal, session 25).

So after the regions, one piece of each kind of block that repeats (`tied.block_pieces`: pieces between the
splitter's candidate cuts with equal op signatures; at most KINDS kinds, the costliest, each piece at least SHARE of
the model's forward seconds and each kind TOTAL) is compiled and timed alone as a region is (`timed.timed_stages`,
each behind a spin of the device so that its launches do not pace it: `calibration.Programs`), on its real params
and batch and random activations (a dense kernel's time does not depend on its values; integer activations are
zeros, so a kernel that branches on them, as a mixture of experts' routing, would not time as it runs). In each
region, a timed kind's equations then take the region's ratio times their kind's ratio over the timed kinds' mean
there, per pass (F, B, W, whole backward), the mean weighted by forward seconds as the cost model weighs a stage's
ratios (`CostModel.stage_scale`): a region's total stays what its program ran, and within it the time moves between
the kinds as their pieces ran. A piece of a kind not timed that shares most (LIKE) of its forward seconds' ops with
a timed kind's piece, both ways, is costed as that kind (`likened`: a Llama's first attention, which also makes
RoPE's tables, ran 0.90 x its plan as the region's ratio costed it, 4 x H100, session 26); a kind alone in its
region, and the other untimed pieces (the embedding), keep the region's ratio.

A piece of a kind of its own is timed too when it holds SINGLE of the forward seconds, is not costed as a timed
kind and shares its region with a timed kind (alone there, its ratio would cancel): a language model's head and
loss. Its region is mostly its own (the regions cut at equal time, and a GPT's head of 50,257 words holds about
four blocks' worth), so the region's ratio was mostly the head's, but not only:
GPT's head-only stage at p = 4 ran 0.86 x its plan's forward and 0.79 x its B where the last block beside it in
the region took the rest (4 x H100, inductor, session 27).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch

import ir

from .calibration import Calibration, ProgramCompiler, signature
from .measured import MeasuredScale, spans_of
from .timed import timed_stages
from .tied import block_pieces

log = logging.getLogger("engine.calibrate")
KINDS = 4  # kinds of piece timed at most (each costs a compile of its four programs)
SHARE = 0.005  # a piece below this share of the model's forward seconds is not timed: its launches, not its work
TOTAL = 0.05  # nor a kind whose pieces together hold less (a norm the head and one block share): its ratio moves
# little
SINGLE = 0.05  # a piece of a kind of its own is timed when it holds this share of the model's forward seconds
LIKE = 0.8  # a piece of an untimed kind whose forward seconds lie this much in a timed kind's ops runs as it does
COVER = 0.5  # nor unless the kinds timed hold this share of the model's forward seconds: a stack of alike blocks
# (a ResNet's repeated pieces are single convolutions and BatchNorm fragments, about 1 % each: its regions stand)
Ratios = tuple[float | None, float | None, float | None, float | None]  # a kind's F, B, W and whole-backward
# ratio to its ops' sums; None where not measured (B and W not timed apart, a pass of no ops)


def timed_pieces(g: ir.Graph, times: Sequence[float]) -> list[tuple[int, int, int]]:
    """(kind, start, stop) of one piece of each kind worth timing (`times`: the equations' forward seconds): kinds
    of two pieces or more, each piece at least SHARE of the total and all of them TOTAL, the KINDS costliest in all,
    the middle piece of each; none unless two kinds qualify (one kind's ratio cancels in its regions) and they
    hold COVER of the total. Then, while fewer than KINDS, the costliest pieces of a kind of their own that hold
    SINGLE of the total and are not costed as a kind timed (`likened`): a language model's head."""
    total = sum(times)
    found: dict[int, list[tuple[int, int]]] = {}
    for kind, start, stop in block_pieces(g):
        found.setdefault(kind, []).append((start, stop))

    def seconds(piece: tuple[int, int]) -> float:
        return sum(times[piece[0]:piece[1]])

    repeated = [(kind, pieces) for kind, pieces in found.items() if len(pieces) >= 2 and total > 0
                and seconds(pieces[0]) >= SHARE * total and seconds(pieces[0]) * len(pieces) >= TOTAL * total]
    repeated.sort(key=lambda item: -seconds(item[1][0]) * len(item[1]))
    chosen = [(kind, *pieces[len(pieces) // 2]) for kind, pieces in repeated[:KINDS]]
    covered = sum(seconds(pieces[0]) * len(pieces) for _, pieces in repeated[:KINDS])
    if len(chosen) < 2 or covered < COVER * total:
        return []
    costed_as = likened(g, chosen, times)
    singles = [(kind, *pieces[0]) for kind, pieces in found.items() if len(pieces) == 1
               and costed_as[pieces[0][0]] == kind and seconds(pieces[0]) >= SINGLE * total]
    singles.sort(key=lambda piece: -seconds(piece[1:]))
    return sorted(chosen + singles[:KINDS - len(chosen)], key=lambda piece: piece[1])


def piece_scale(g: ir.Graph, device: torch.device, region: MeasuredScale, cal: Calibration,
                inputs: Sequence[torch.Tensor], *, level: bool | str = False, repeats: int = 3,
                compile_program: ProgramCompiler = ir.compile_graph) -> tuple[MeasuredScale, Calibration]:
    """`region` (the region scale of microbatch graph `g`) spread over the kinds of block in each region (the module
    docstring), and `cal` with the ops only the pieces' programs have timed; `region` as it is where no two kinds
    are worth timing or a piece cannot be timed (logged)."""
    times = [cal.times.get(signature(e), 0.0) for e in g.eqns]
    if not region.matches(g):
        return region, cal
    chosen = accompanied(g, timed_pieces(g, times), region, times)
    if not chosen:
        return region, cal
    stages = [_piece(g, start, stop) for _, start, stop in chosen]

    def given(stage: ir.Stage, _: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        return [inputs[i] for i in (*stage.param_ids, *stage.batch_ids)]  # the activations: random

    runs, cal = timed_stages(stages, device, cal, given, level=level, repeats=repeats,
                             compile_program=compile_program, what="piece scales", queued=True)
    if runs is None:
        return region, cal
    ratios = {kind: _ratios(run) for (kind, _, _), run in zip(chosen, runs)}
    log.info("calibration: pieces of each kind run %s their ops' calibrated sum (F / B / W / BW)",
             "; ".join(f"eqns {start}:{stop} " + " / ".join("-" if x is None else f"{x:.2f}" for x in ratios[kind])
                       for kind, start, stop in chosen))
    return spread(region, likened(g, chosen, times), ratios, times), cal


def accompanied(g: ir.Graph, chosen: Sequence[tuple[int, int, int]], region: MeasuredScale,
                times: Sequence[float]) -> list[tuple[int, int, int]]:
    """`chosen` (`timed_pieces`) without each piece of a kind of its own whose region (a span of `region`) holds
    no other kind timed: alone there, its ratio cancels (`spread`), and timing it would cost its compiles for
    nothing (a head and loss that hold a region's whole time)."""
    counts: dict[int, int] = {}
    for kind, _, _ in block_pieces(g):
        counts[kind] = counts.get(kind, 0) + 1
    kinds = likened(g, chosen, times)
    timed = {kind for kind, _, _ in chosen}

    def company(kind: int, start: int) -> bool:
        span = next((s for s in region.spans if s.start <= start < s.stop), None)
        return span is not None and any(kinds[i] in timed - {kind} for i in range(span.start, span.stop))

    return [(kind, start, stop) for kind, start, stop in chosen if counts[kind] >= 2 or company(kind, start)]


def likened(g: ir.Graph, chosen: Sequence[tuple[int, int, int]], times: Sequence[float]) -> list[int]:
    """Each equation's kind (`tied.block_pieces`), a piece of a kind not timed taking a timed kind (of `chosen`)
    where at least LIKE of its forward seconds (`times`) lie in ops of that kind's piece and LIKE of that piece's
    in its ops: a Llama's first attention, which also makes RoPE's tables, runs as the attentions timed do (a
    final norm, whose ops an MLP piece starts with, does not)."""
    def ops(start: int, stop: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for e, t in zip(g.eqns[start:stop], times[start:stop]):
            out[signature(e)] = out.get(signature(e), 0.0) + t
        return out

    def like(a: dict[str, float], b: dict[str, float]) -> bool:  # most of a's seconds in b's ops, and of b's in a's
        return all(sum(t for k, t in x.items() if k in y) >= LIKE * sum(x.values()) > 0 for x, y in ((a, b), (b, a)))

    timed = {kind: ops(start, stop) for kind, start, stop in chosen}
    kinds: list[int] = []
    for kind, start, stop in block_pieces(g):
        if kind not in timed:
            mine = ops(start, stop)
            kind = next((k for k, theirs in timed.items() if like(mine, theirs)), kind)
        kinds += [kind] * (stop - start)
    return kinds


def _piece(g: ir.Graph, start: int, stop: int) -> ir.Stage:
    """Equations [start, stop) of `g` as a stage of their own."""
    cuts = [c for c in (start, stop) if 0 < c < len(g.eqns)]
    return next(s for s in ir.split(g, cuts) if s.start == start)


def _ratios(run: Sequence[Any]) -> Ratios:
    """A timed piece's F, B, W and whole-backward seconds over its ops' sums (`timed.timed_stages`' run); None
    for a pass of no ops, and for B and W where they were not timed apart."""
    forward = run[4] / run[2] if run[2] > 0 else None
    backward = run[5] / run[3] if run[3] > 0 else None
    if backward is None or run[6] is None:
        return forward, None, None, backward
    return forward, backward * run[6], backward * run[7], backward


def spread(region: MeasuredScale, kinds: Sequence[int], ratios: Mapping[int, Ratios],
           times: Sequence[float]) -> MeasuredScale:
    """`region` with each pass's ratio of a timed kind's equation (`kinds[i]` in `ratios`) multiplied, in its
    region, by its kind's ratio over the timed kinds' mean there, weighted by `times` (forward seconds): each
    region's time-weighted ratio is kept, equations of kinds not timed keep theirs. A kind whose ratio of a pass is
    None (not measured: B and W not timed apart, an embedding's empty B) keeps the region's ratio in that pass, and
    the others are spread among themselves: the kinds' ratios compare only where measured alike."""
    columns = [list(column) for column in region.columns()]
    for span in region.spans:
        timed = [i for i in range(span.start, span.stop) if kinds[i] in ratios and times[i] > 0]
        for p, column in enumerate(columns):
            measured = [i for i in timed if ratios[kinds[i]][p] is not None]
            weight = sum(times[i] for i in measured)
            raw = sum(times[i] * ratios[kinds[i]][p] for i in measured)  # type: ignore[operator]
            if weight <= 0 or raw <= 0:
                continue
            for i in measured:
                column[i] *= ratios[kinds[i]][p] * weight / raw  # type: ignore[operator]
    return MeasuredScale(region.num_eqns, spans_of(columns), region.batch)
