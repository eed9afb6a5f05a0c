"""Calibration: measured seconds per op signature on the real device, cached in a dict or a JSON file.

Each distinct signature (op, input shapes and dtypes, constant arguments) runs once on random tensors
of its shapes (integers are zeros, so indices are valid); the median of a few runs is kept. A model of
N identical blocks measures one block's ops, not N.
"""
from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
from torch.utils import _pytree as pytree

import ir

log = logging.getLogger(__name__)

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
    return hashlib.sha1(f"{e.op}|{args}|{kwargs}".encode()).hexdigest()[:20]


@attrs.frozen
class Calibration:
    """Measured seconds by op signature, for one device."""

    device: str
    times: Mapping[str, float] = attrs.field(factory=dict, converter=dict)

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "times": dict(sorted(self.times.items()))})

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        d = json.loads(text)
        return cls(d["device"], {k: float(v) for k, v in d["times"].items()})

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
    """Median seconds of equation `index` of `g` on `device`, on random inputs of its shapes."""
    sub = ir.slice_graph(g, [index])
    inputs = [_random_input(v, device) for v in sub.inputs]
    ir.interpret(sub, inputs)  # warm-up: first-call allocation and kernel selection
    runs = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        ir.interpret(sub, inputs)
        _sync(device)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def calibrate(g: ir.Graph, device: str | torch.device = "cuda", *, repeats: int = 5,
              calibration: Calibration | None = None) -> Calibration:
    """Time every op signature of `g` not yet in `calibration` once on `device`; returns the merged table.
    An op that cannot run on random inputs keeps its roofline estimate (logged at debug level)."""
    dev = torch.device(device)
    times = dict(calibration.times) if calibration is not None else {}
    for i, e in enumerate(g.eqns):
        cost = ir.eqn_cost(e)
        key = signature(e)
        if key in times or (cost.flops == 0 and cost.bytes == 0):
            continue
        try:
            times[key] = time_eqn(g, i, dev, repeats=repeats)
        except RuntimeError as err:
            log.debug("not calibrated: %s on random inputs failed: %s", e.op, err)
    return Calibration(calibration.device if calibration is not None else str(dev), times)


def calibrate_training(g: ir.Graph, device: str | torch.device = "cuda", *, repeats: int = 5,
                       calibration: Calibration | None = None) -> Calibration:
    """Calibrate every op a training step of model graph `g` runs: its own equations (what the splitter
    estimates from) and the forward, B and W graphs that stage autodiff makes of it."""
    dev = torch.device(device)
    ad = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs)), device=str(dev))
    cal = calibrate(g, dev, repeats=repeats, calibration=calibration)
    for part in (ad.forward, ad.backward_input, ad.backward_weight):
        cal = calibrate(part.graph, dev, repeats=repeats, calibration=cal)
    return cal
