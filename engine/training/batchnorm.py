"""BatchNorm in train mode as functional state: batch statistics per microbatch, running statistics per step.

    model = resnet().train()
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    (loss, state), grads = fn_and_grad(...)                   # one process: the plain function
    step = engine.parallelize(fn, variables, x, y, has_aux=True)
    variables = step.shard(variables)
    (loss, state), grads = step(variables, x, y)
    variables = engine.module.updated(variables, state)       # the new running statistics, None stays None

Semantics (those of GPipe, with torchgpipe's deferred batch norm for the statistics):
  - Normalisation uses the statistics of the microbatch being computed (each of the step's
    microbatches x dp parts is normalised with its own mean and biased variance), so the loss and grads
    are the average over the microbatches of `torch.func.grad` of the function on each microbatch: they
    depend on the microbatch size, as on any data-parallel job with per-device BatchNorm, and on nothing
    else of the layout (schedule, stages, which replica a microbatch runs on).
  - The running statistics after a step are those of ONE forward over the full batch, whatever the
    layout: running_mean <- (1-f) running_mean + f mean, running_var <- (1-f) running_var + f var * n/(n-1)
    with mean and var over the whole batch (n values per channel), f = momentum, or 1/num_batches_tracked
    (after its increment) when momentum is None (PyTorch's cumulative average); num_batches_tracked (int64)
    grows by 1 per step. The function called on one process, on the full batch, is that reference.
  - The state comes back as the aux of a has_aux function, as Flax's mutable collections do:
    `fn(variables, *batch) -> (loss, {"buffers": {path: {running_mean, running_var, num_batches_tracked}}})`
    with the train-mode BatchNorm layers only; nothing is written into the module or the variables.

How (see ir.deferred): each microbatch computes, from the BN layer's input (detached: statistics carry no
gradient), per channel the biased variance v and mean mu and, with d = mu - running_mean and
s = v + d^2 (the mean of (x - running_mean)^2), a [4, C] tensor [(1-f) rm + f mu, (1-f) rv + f s, f s,
sqrt(f) d] and the count of values per channel with num_batches_tracked + 1 (float64). Each is linear in
the microbatch, so the step's average over microbatches and replicas is the full batch's; the finish then
adds the part that is not: var = S - D^2 (S, D the averages), made unbiased with the full count n:
running_var = [(1-f) rv + f S] + f S / (n-1) - n/(n-1) (sqrt(f) D)^2. Shifting by the running mean keeps
S - D^2 from cancelling when the mean is large against the spread. These travel with the loss (the aux
leaves reach the last stage and are summed over replicas), one [4, C] and one [2] tensor per layer per
microbatch, and are summed in float32 (float64 for float64 models) whatever the compute dtype. Costs: one
extra `var_mean` pass over each BN input in the forward.

SyncBatchNorm is treated as BatchNorm: each microbatch is normalised on its own (no cross-rank
statistics inside a step); its running statistics are still the full batch's. A BatchNorm layer with
track_running_stats=False is pure already (batch statistics, no state) and is run as it is.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import ir

__all__ = ["DEFAULT_MIN_MICROBATCH", "finish", "nest", "recording", "stateful", "train_layers", "updated"]

# Batch statistics over fewer samples are noisy enough to hurt accuracy: Wu & He (Group Normalization,
# 2018, fig. 1) measure ResNet-50 ImageNet error rising from 23.6 % at 32 per device to 24.0 % at 16 and
# 26.8 % at 8, 34.7 % at 4; 16 is the smallest size at which BN is within half a point of its usual value.
DEFAULT_MIN_MICROBATCH = 16


def train_layers(module: nn.Module) -> dict[str, _BatchNorm]:
    """The BatchNorm layers (by module path) that update running statistics in the module's current mode."""
    return {name: m for name, m in module.named_modules()
            if isinstance(m, _BatchNorm) and m.training and m.track_running_stats}


@contextlib.contextmanager
def recording(layers: dict[str, _BatchNorm]) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
    """While active, each layer normalises with its batch statistics without touching its buffers and
    records its partial statistics (see the module docstring) into the yielded dict, by module path."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, m in layers.items():
        m.forward = _forward(m, name, parts)  # type: ignore[method-assign]
    try:
        yield parts
    finally:
        for m in layers.values():
            del m.forward


def _forward(m: _BatchNorm, name: str, parts: dict[str, dict[str, torch.Tensor]]) -> Callable[[torch.Tensor], Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        m._check_input_dim(x)
        parts[name] = _partial(m, x)
        return F.batch_norm(x, None, None, m.weight, m.bias, True, 0.0, m.eps)
    return forward


def _partial(m: _BatchNorm, x: torch.Tensor) -> dict[str, torch.Tensor]:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dims = [d for d in range(x.dim()) if d != 1]
    var, mean = torch.var_mean(x.detach().to(acc), dims, correction=0)
    rm, rv = m.running_mean.to(acc), m.running_var.to(acc)  # type: ignore[union-attr]
    tracked = (m.num_batches_tracked + 1).to(torch.float64)  # type: ignore[operator]
    f = 1.0 / tracked.to(acc) if m.momentum is None else torch.full((), float(m.momentum), dtype=acc, device=x.device)
    d = mean - rm
    s = var + d * d
    moments = torch.stack([(1 - f) * rm + f * mean, (1 - f) * rv + f * s, f * s, f.sqrt() * d])
    count = torch.full((), x.numel() // x.shape[1], dtype=torch.float64, device=x.device)
    return {"moments": moments, "counts": torch.stack([count, tracked])}


def finish(layers: dict[str, _BatchNorm]) -> Callable[[Any, int], dict[str, Any]]:
    """The deferred half: averaged partials of `parts` microbatches -> {"buffers": new running statistics}."""
    dtypes = {name: m.running_mean.dtype for name, m in layers.items()}  # type: ignore[union-attr]

    def done(partial: dict[str, Any], parts: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, dtype in dtypes.items():
            got = _leaf(partial["bn"], name)
            mean, var, fs, gd = got["moments"].unbind(0)
            n = torch.round(got["counts"][0]).to(var.dtype) * parts  # a tensor: the function stays traceable
            new_var = var + fs / (n - 1) - (n / (n - 1)) * gd * gd
            tracked = torch.round(got["counts"][1]).to(torch.int64)
            _put(out, name, {"running_mean": mean.to(dtype), "running_var": new_var.to(dtype),
                             "num_batches_tracked": tracked})
        return {"buffers": out}
    return done


def stateful(local: Callable[..., tuple[torch.Tensor, Any]], layers: dict[str, _BatchNorm], name: str) -> Callable:
    """`ir.deferred(local, finish)`: `local` returns (loss, {"bn": partials by module path})."""
    first = next(iter(layers))
    why = f"BatchNorm in train mode ('{first}' and {len(layers) - 1} more layers)" if len(layers) > 1 else \
        f"BatchNorm in train mode ('{first}')"
    return ir.deferred(local, finish(layers), name=name, min_microbatch=DEFAULT_MIN_MICROBATCH,
                       why=why + ": batch statistics over fewer rows are noise")


def nest(parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """{"bn": partials nested by module path}, the aux `local` returns."""
    out: dict[str, Any] = {}
    for name, value in parts.items():
        _put(out, name, value)
    return {"bn": out}


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split(".") if path else [""]
    for part in head:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _leaf(tree: dict[str, Any], path: str) -> Any:
    for part in path.split(".") if path else [""]:
        tree = tree[part]
    return tree


def updated(variables: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """`variables` with the leaves of `state` (a step's or the function's returned state) in place of
    theirs; a leaf that is None in `variables` (held by another rank) stays None, so a sharded tree stays
    sharded. A state leaf with no place in `variables` raises KeyError naming it."""
    def merge(into: Any, new: Any, where: str) -> Any:
        if isinstance(new, dict):
            if not isinstance(into, dict):
                raise KeyError(f"the state has '{where}', which the variables do not; update the tree this module "
                               "made (engine.functionalize)")
            missing = [k for k in new if k not in into]
            if missing:
                raise KeyError(f"the state has '{(where + '.' + missing[0]).lstrip('.')}', which the variables do "
                               "not; update the tree this module made (engine.functionalize)")
            return {k: merge(v, new[k], f"{where}.{k}") if k in new else v for k, v in into.items()}
        return None if into is None else new.to(into.device)
    return merge(variables, state, "")
