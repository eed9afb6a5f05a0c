"""The cost model: seconds per equation (roofline of a device profile, or calibrated) and per message.

An equation takes `launch + max(flops / achievable FLOP/s, bytes / achievable bandwidth)` with FLOPs
and bytes from `ir.eqn_cost`; view-like equations are free. Where a calibration table holds the op's
signature (op, shapes, dtypes, constant args), the measured time wins, times the table's program scale
(how much longer whole programs ran than their ops timed alone: the forward one, or in B and W the backward
one; a roofline time takes neither). Each weight grad is added into
its accumulator once per microbatch (`accumulate_time`), charged to W. Before stage autodiff exists
for a stage, its backward is estimated per forward equation: a matrix op costs one forward per matrix
operand (2.5 forwards for attention), charged to B (input grads) when the operand depends on the batch and
to W (weight grads) when it derives from parameters alone; any other op costs one forward, in B unless
all its differentiable inputs are parameters.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import attrs
import torch

import ir
from ir.device import rank_neutral
from ir.costs import base_name

from .calibration import Calibration, accumulate_signature, signature
from .devices import DeviceProfile, LinkProfile
from .measured import MeasuredScale, combined

ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
})
MATRIX_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "linear", "matmul", "einsum", "convolution", "_convolution",
    "conv1d", "conv2d", "conv3d", "convolution_backward",
}) | ATTENTION_OPS | frozenset(f"{op}_backward" for op in ATTENTION_OPS)
BACKWARD_FACTOR = dict.fromkeys(ATTENTION_OPS, 2.5)  # forwards per differentiable input; default 1


def eqn_dtype(e: ir.Eqn) -> torch.dtype:
    """The dtype an op computes in: its first floating input's, else its first output's."""
    for v in (*e.inputs, *e.out_vars):
        if v.aval.dtype.is_floating_point:
            return v.aval.dtype
    return e.out_vars[0].aval.dtype if e.out_vars else torch.float32


@attrs.frozen
class CostModel:
    """Times of equations, graphs and messages for one device and link."""

    device: DeviceProfile
    link: LinkProfile
    calibration: Calibration | None = None
    measured: MeasuredScale | None = None  # the stage programs' measured / planned seconds (engine.planning.measured)
    placed: bool = True  # False: no per-span scale (a block's cost shared by the blocks that print alike)
    split_backward: bool = True  # the schedule runs B and W apart; else fused, both at the whole backward's ratio
    _scales: dict[int, tuple[ir.Graph, MeasuredScale | None]] = attrs.field(factory=dict, init=False, eq=False,
                                                                          repr=False)  # per graph: scale_of

    @property
    def backward_ratio(self) -> float:
        """How much more than a forward op's a backward op's calibrated time is scaled (the calibration's
        backward over forward program scale; 1 uncalibrated). Only calibrated times take it (`eqn_time`,
        `calibrated`): a roofline time has no program scale to correct."""
        return 1.0 if self.calibration is None else self.calibration.backward_ratio

    def calibrated(self, e: ir.Eqn) -> bool:
        """Whether the calibration table times `e` (its time then carries the program scales)."""
        return self.calibration is not None and signature(e) in self.calibration.times

    def scale_of(self, graph: ir.Graph) -> MeasuredScale | None:
        """The per-span ratios that apply to microbatch graph `graph`: the calibration's region scales
        (engine.planning.regions) times the stage programs' measured ones, each only if measured on this graph."""
        if not self.placed:
            return None
        hit = self._scales.get(id(graph))
        if hit is None or hit[0] is not graph:
            region = self.calibration.region if self.calibration is not None else None
            mine = [s if s is not None and s.matches(graph) else None for s in (region, self.measured)]
            hit = self._scales[id(graph)] = (graph, combined(*mine))
        return hit[1]

    def stage_scale(self, graph: ir.Graph, start: int, stop: int) -> tuple[float, float, float]:
        """The measured F, B, W ratios of equations [start, stop) of the microbatch graph ((1, 1, 1) unmeasured);
        without `split_backward`, B's and W's are both the whole backward's (`measured.Span.fused`): split apart,
        B and W cost more than as one program (a Llama block's 5-6 % on an H100, inductor)."""
        scale = self.scale_of(graph)
        if scale is None:
            return 1.0, 1.0, 1.0
        times = [self.eqn_time(e) for e in graph.eqns[start:stop]]
        f, b, w = scale.of_range(times, start, stop, len(graph.eqns))
        if not self.split_backward:  # one BW program: B's and W's ops at the whole backward's ratio
            b = w = scale.fused_of_range(times, start, stop, len(graph.eqns))
        return f, b, w

    def stage_fused_scale(self, graph: ir.Graph, start: int, stop: int) -> float:
        """The measured whole-backward ratio of equations [start, stop) (`measured.Span.fused`; 1 unmeasured)."""
        scale = self.scale_of(graph)
        if scale is None:
            return 1.0
        return scale.fused_of_range([self.eqn_time(e) for e in graph.eqns[start:stop]], start, stop, len(graph.eqns))

    def eqn_scales(self, graph: ir.Graph) -> tuple[list[float], list[float], list[float]] | None:
        """Each equation's measured F, B, W ratio for the microbatch graph, or None (unmeasured, another graph);
        as `stage_scale`, B's and W's the whole backward's without `split_backward`."""
        scale = self.scale_of(graph)
        ratios = None if scale is None else scale.per_eqn(len(graph.eqns))
        if ratios is None or self.split_backward:
            return ratios
        fused = scale.fused_per_eqn(len(graph.eqns))
        assert scale is not None and fused is not None
        return ratios[0], fused, fused

    def eqn_time(self, e: ir.Eqn, *, backward: bool = False) -> float:
        """Predicted seconds for one equation; zero for views. A calibrated time carries the forward program
        scale, or with `backward` the backward one."""
        cost = ir.eqn_cost(e)
        if cost.flops == 0 and cost.bytes == 0:
            return 0.0
        if self.calibration is not None:
            measured = self.calibration.times.get(signature(e))
            if measured is not None:
                return measured * _program_scale(self.calibration, backward)
        rate = self.device.flops_for(eqn_dtype(e), base_name(e.op) in MATRIX_OPS)
        return self.device.launch_overhead + max(cost.flops / rate, cost.bytes / self.device.bandwidth)

    def accumulate_time(self, aval: ir.AbstractValue) -> float:
        """Seconds of the runtime's `acc.add_(grad)` for one weight grad (read both, write one), part of a
        backward program: a calibrated time at the backward program scale."""
        if self.calibration is not None:
            measured = self.calibration.times.get(accumulate_signature(aval))
            if measured is not None:
                return measured * _program_scale(self.calibration, backward=True)
        return self.device.launch_overhead + 3 * aval.nbytes / self.device.bandwidth

    def params_accumulate_time(self, g: ir.Graph, params: Sequence[int]) -> float:
        """Seconds to accumulate the weight grads of graph params `params` (float ones) once."""
        return sum(self.accumulate_time(g.inputs[p].aval) for p in params
                   if g.inputs[p].aval.dtype.is_floating_point)


    def eqn_times(self, g: ir.Graph, *, backward: bool = False) -> list[float]:
        return [self.eqn_time(e, backward=backward) for e in g.eqns]

    def graph_time(self, g: ir.Graph, *, backward: bool = False) -> float:
        """Predicted seconds to run every equation of `g` once, one after another (`backward`: as part of a
        backward program, calibrated times at the backward program scale)."""
        return sum(self.eqn_times(g, backward=backward))

    def comm_time(self, nbytes: int | float) -> float:
        """Seconds to send `nbytes` over the link (0 when nothing crosses)."""
        return self.link.time(nbytes)

    def allreduce_time(self, nbytes: int | float, ranks: int) -> float:
        """Ring all-reduce of `nbytes` over `ranks` replicas: 2(n-1)/n of the bytes, 2(n-1) latencies."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (ranks - 1)
        return steps * self.link.latency + steps / ranks * nbytes / self.link.bandwidth


def _grad_kinds(g: ir.Graph) -> tuple[set[ir.Var], set[ir.Var]]:
    """Values that carry gradient (derived from float params), and those derived from params alone."""
    params = set(g.params)
    diff = {v for v in g.params if v.aval.dtype.is_floating_point}
    param_only = set(params)
    for e in g.eqns:
        ins = e.inputs
        for v in e.out_vars:
            if v.aval.dtype.is_floating_point and any(u in diff for u in ins):
                diff.add(v)
            if ins and all(u in param_only for u in ins):
                param_only.add(v)
    return diff, param_only


def backward_estimates(g: ir.Graph, times: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per forward equation, estimated seconds of its share of B and of W (see the module docstring)."""
    diff, param_only = _grad_kinds(g)
    b_times, w_times = [0.0] * len(g.eqns), [0.0] * len(g.eqns)
    for i, e in enumerate(g.eqns):
        if not times[i] or not any(v in diff for v in e.out_vars):
            continue
        grads = [u for u in dict.fromkeys(e.inputs) if u in diff]
        base = base_name(e.op)
        cost = times[i] * BACKWARD_FACTOR.get(base, 1.0)
        if base in MATRIX_OPS:  # one product per matrix operand; a bias grad is a cheap row sum
            for u in (u for u in grads if len(u.aval.shape) >= 2):
                if u in param_only:
                    w_times[i] += cost
                else:
                    b_times[i] += cost
        elif all(u in param_only for u in grads):
            w_times[i] += cost
        else:  # one fused kernel makes every input grad, and it runs in B (as in stage autodiff)
            b_times[i] += cost
    return b_times, w_times


def graph_hash(g: ir.Graph) -> str:
    """sha256 of the printed graph (ops, shapes, dtypes, wiring) and its input names; device indices left out
    (`ir.device.rank_neutral`: rank 1's factory ops print cuda:1, and its plan must equal rank 0's)."""
    text = str(g) + "\n" + "\n".join(f"{n}:{v.aval}" for n, v in zip(g.input_names, g.inputs))
    return hashlib.sha256(rank_neutral(text).encode()).hexdigest()


def _program_scale(calibration: Calibration, backward: bool) -> float:
    """What a calibrated op's time is multiplied by: the forward program scale, or the backward one."""
    return calibration.scale * (calibration.backward_ratio if backward else 1.0)
