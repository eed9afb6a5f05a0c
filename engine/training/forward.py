"""A module's eval-mode forward as a pure function `forward(variables, *inputs) -> outputs` (step.evaluate runs it)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.func import functional_call

__all__ = ["eval_forward"]


def eval_forward(module: nn.Module, names: Callable[[dict], Any]) -> Callable[..., Any]:
    """`forward(variables, *inputs)`: the module's output with every submodule in eval mode for the call
    (BatchNorm uses its running statistics, dropout is the identity), the module's own modes untouched.
    `names(tree)` flattens a variables collection to (dotted name, tensor) pairs."""

    def forward(variables: dict[str, dict], *inputs: Any) -> Any:
        tensors = {**dict(names(variables["params"])), **{k: v.detach() for k, v in names(variables["buffers"])}}
        with _eval_mode(module):
            return functional_call(module, tensors, tuple(inputs))

    forward.__name__ = f"{type(module).__name__}_forward"
    return forward


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in module.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
