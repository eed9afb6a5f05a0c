"""Caches for the harness: tracing and stage autodiff cost far more than running a tiny model's step."""
from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

import ir

from ..emit import StageInfo

GRAPHS_SIZE = 64
STAGES_SIZE = 2048  # a stage's slice and autodiff depend on its first and end equation alone


class _LRU(collections.OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make: Callable[[], Any], valid: Callable[[Any], bool] = lambda _: True) -> Any:
        if key in self and valid(self[key]):
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return value


_GRAPHS, _STAGES = _LRU(GRAPHS_SIZE), _LRU(STAGES_SIZE)


def _avals(tree: Any) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten(tree)
    return (spec, *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves))


def graph_of(fn: Callable, params: Any, batch: Sequence[Any]) -> ir.Graph:
    """`ir.trace(fn, params, *batch)` on CPU, cached by `fn` and the shapes and dtypes of the arguments."""
    return _GRAPHS.get_or((fn, _avals((params, *batch))), lambda: ir.trace(fn, params, *batch, device="cpu"))


def _signature(st: ir.Stage) -> tuple[Any, ...]:
    return (st.start, st.stop, st.param_ids, st.batch_ids, st.acts_in, st.acts_out)


def stage_infos(graph: ir.Graph, cuts: Sequence[int]) -> list[StageInfo]:
    """`engine.step.stage_infos` on CPU, reusing the autodiff of every stage whose bounds were seen before."""
    out = []
    for st in ir.split(graph, cuts):
        def make(st: ir.Stage = st) -> tuple[Any, ...]:
            const = range(len(st.param_ids), len(st.param_ids) + len(st.batch_ids))
            return graph, _signature(st), ir.stage_autodiff(st.graph, constant=const, device="cpu")

        # The entry keeps its graph alive, so id(graph) cannot be reused while the entry exists.
        hit = _STAGES.get_or((id(graph), st.start, st.stop), make,
                             valid=lambda h, st=st: h[0] is graph and h[1] == _signature(st))
        out.append(StageInfo(st, hit[2]))
    return out
