"""Strategies, fixed models and helpers shared by the ir tests."""
from __future__ import annotations

import os
from typing import Any

import torch
from hypothesis import strategies as st

import ir
from engine.testing import Layer, ModelSpec, build

SCALE = float(os.environ.get("FNPIPE_EXAMPLES", "1"))  # FNPIPE_EXAMPLES=10: ten times the examples


def examples(n: int) -> int:
    """`n` hypothesis examples, scaled by $FNPIPE_EXAMPLES for thorough runs."""
    return max(1, int(n * SCALE))


def cut_sets(num_eqns: int, max_cuts: int = 3) -> st.SearchStrategy[list[int]]:
    """0..max_cuts strictly increasing cut positions inside (0, num_eqns)."""
    if num_eqns < 2:
        return st.just([])
    return st.lists(st.integers(1, num_eqns - 1), max_size=max_cuts, unique=True).map(sorted)


def trace_case(case: Any) -> ir.Graph:
    return ir.trace(case.fn, case.params, *case.batch)


def _spec(layers: tuple[Layer, ...], **kw: Any) -> ModelSpec:
    base = dict(tokens=False, d_in=8, vocab=7, embed_op="embedding", head="mse", tied=False, outputs=3,
                batch_size=8, seq=3, z_width=0)
    base.update(kw)
    return ModelSpec(layers=layers, **base)


L = Layer
ZOO: dict[str, ModelSpec] = {
    "mlp": _spec((L("linear", 12, "tanh"), L("linear", 8, "relu_"), L("linear", 4, "gelu"))),
    "transformer_lm_tied": _spec(
        (L("layernorm"), L("attention", heads=2, causal=True), L("layernorm"), L("residual", 16, "gelu")),
        tokens=True, head="lm", tied=True),
    "skips_and_streams": _spec(
        (L("save", slot=0), L("fork", 4), L("linear", 12, "silu"), L("aux", act="tanh"), L("save", slot=1),
         L("shared", 12), L("skip", slot=0), L("inject", 12), L("shared", 12), L("skip", slot=1)),
        z_width=4, head="cls"),
    "gather_embedding": _spec((L("attention", heads=4), L("layernorm", affine=False), L("residual", 8, "sigmoid")),
                              tokens=True, embed_op="index", head="cls"),
    "two_streams_two_losses": _spec((L("fork", 8), L("linear", 8, "tanh"), L("aux", act="relu"), L("merge"),
                                     L("fork", 4), L("residual", 4, "gelu"), L("aux", act="identity"))),
}


def zoo(name: str, dtype: torch.dtype = torch.float64) -> Any:
    return build(ZOO[name], dtype=dtype, seed=1234)
