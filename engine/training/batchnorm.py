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

How (see ir.deferred): each microbatch normalises with `native_batch_norm`, which returns its batch
mean mu and inverse standard deviation 1/sqrt(v + eps) (v: biased variance) beside the output; from these,
with no further pass over the input, it emits one [6, C] tensor per layer: d = mu - running_mean,
s' = 1/invstd^2 + d^2 (= v + eps + d^2), the running mean and variance, the count of values per channel and
num_batches_tracked + 1. Each row is linear in the microbatch (or the same in every one), so the step's
average over microbatches and replicas is the full batch's: D, S' and the constants. The finish adds the
part that is not linear: with S = S' - eps (the mean of (x - running_mean)^2) the full batch's biased
variance is S - D^2, its mean running_mean + D, and with f = momentum (or 1/num_batches_tracked) and n the
full count: running_mean <- running_mean + f D, running_var <- (1-f) running_var + f (S - D^2) n/(n-1).
Shifting by the running mean keeps S - D^2 from cancelling when the mean is large against the spread.
The partials travel with the loss (aux leaves reach the last stage and are summed over replicas), in float32
(float64 for float64 models) whatever the compute dtype; counts and steps are rounded back to integers
(exact below 2^24 values per channel per microbatch and 2^24 steps in float32). Costs per layer and
microbatch: about ten kernels on [C]-sized tensors (the first version spent a cast and a `var_mean` pass
over the whole input and about 35 small kernels; on two H200s in fx mode those made a wide ResNet's step
host-bound).

SyncBatchNorm is treated as BatchNorm: each microbatch is normalised on its own (no cross-rank
statistics inside a step); its running statistics are still the full batch's. A BatchNorm layer with
track_running_stats=False is pure already (batch statistics, no state) and is run as it is.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
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
def recording(layers: dict[str, _BatchNorm]) -> Iterator[dict[str, torch.Tensor]]:
    """While active, each layer normalises with its batch statistics without touching its buffers and
    records its partial statistics (see the module docstring) into the yielded dict, by module path."""
    parts: dict[str, torch.Tensor] = {}
    for name, m in layers.items():
        m.forward = _forward(m, name, parts)  # type: ignore[method-assign]
    try:
        yield parts
    finally:
        for m in layers.values():
            del m.forward


def _forward(m: _BatchNorm, name: str, parts: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        m._check_input_dim(x)
        consts, rm = _constants(m, x)
        out, mean, invstd = torch.native_batch_norm(x, m.weight, m.bias, None, None, True, 0.0, m.eps)
        parts[name] = _partial(consts, rm, _as(mean.detach(), rm.dtype), _as(invstd.detach(), rm.dtype))
        return out
    return forward


def _constants(m: _BatchNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[running mean, running variance, count, num_batches_tracked + 1] as [4, C] rows in the statistics'
    dtype, and the running mean alone. Made before the normalisation, so that every buffer of the layer is
    read before its weights, as eval mode's batch_norm reads them all in one op: evaluation runs on the
    training plan's cuts, and a cut between this and the normalisation still leaves each eval op one stage.
    No tensor indexing here: a CPU-only torch cannot index a fake cuda tensor (planning for GPUs on CPU)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rm, rv = _as(m.running_mean, acc), _as(m.running_var, acc)  # type: ignore[arg-type]
    count = torch.full(rm.shape, x.numel() // x.shape[1], dtype=acc, device=x.device)
    tracked = (m.num_batches_tracked + 1).to(acc).expand_as(rm)  # type: ignore[operator]
    return torch.stack([rm, rv, count, tracked]), rm


def _partial(consts: torch.Tensor, rm: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """The [6, C] rows of one microbatch: d = mean - running mean, v + eps + d^2, then `consts`."""
    d = mean - rm
    s = torch.addcmul(invstd.pow(-2), d, d)
    return torch.cat([torch.stack([d, s]), consts])


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def finish(layers: dict[str, _BatchNorm]) -> Callable[[Any, int], dict[str, Any]]:
    """The deferred half: averaged partials of `parts` microbatches -> {"buffers": new running statistics}.
    Layers with the same settings are updated together, their [6, C] partials side by side: every step of the
    update is elementwise, so the numbers are those of one layer at a time, in a dozen kernels instead of a
    dozen per layer (a ResNet-101 has 104 BatchNorm layers, run once a step on the host's critical path)."""
    consts = {name: (m.running_mean.dtype, m.momentum, m.eps) for name, m in layers.items()}  # type: ignore[union-attr]

    def done(partial: dict[str, Any], parts: int) -> dict[str, Any]:
        groups: dict[tuple[Any, ...], list[tuple[str, torch.Tensor]]] = {}
        for name, settings in consts.items():
            leaf = _leaf(partial["bn"], name)
            groups.setdefault((leaf.dtype, leaf.device, *settings), []).append((name, leaf))
        new: dict[str, dict[str, torch.Tensor]] = {}
        for (_, _, dtype, momentum, eps), members in groups.items():
            rows = members[0][1] if len(members) == 1 else torch.cat([leaf for _, leaf in members], dim=1)
            mean, var, steps = _update(rows, parts, momentum, eps, dtype)
            sizes = [leaf.shape[1] for _, leaf in members]
            at = 0
            for (name, _), m, v, size in zip(members, mean.split(sizes), var.split(sizes), sizes):
                new[name] = {"running_mean": m.clone() if len(members) > 1 else m,  # not views of the group's
                             "running_var": v.clone() if len(members) > 1 else v,
                             "num_batches_tracked": steps.narrow(0, at, 1).reshape(()).to(torch.int64)}
                at += size
        out: dict[str, Any] = {}
        for name in consts:  # the traced order of the buffers' tree
            _put(out, name, new[name])
        return {"buffers": out}
    return done


def _update(rows: torch.Tensor, parts: int, momentum: float | None, eps: float, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new running mean and variance (in `dtype`) and num_batches_tracked (rounded, per channel) from the
    [6, C] averaged partials (the module docstring's formulas)."""
    d, s, rm, rv, count, tracked = rows.unbind(0)
    n = torch.round(count) * parts  # tensors: the function stays traceable
    steps = torch.round(tracked)
    f = 1.0 / steps if momentum is None else torch.full_like(d, float(momentum))
    var = (s - eps) - d * d
    return (rm + f * d).to(dtype), ((1 - f) * rv + f * var * n / (n - 1)).to(dtype), steps


def stateful(local: Callable[..., tuple[torch.Tensor, Any]], layers: dict[str, _BatchNorm], name: str) -> Callable:
    """`ir.deferred(local, finish)`: `local` returns (loss, {"bn": partials by module path})."""
    first = next(iter(layers))
    why = f"BatchNorm in train mode ('{first}' and {len(layers) - 1} more layers)" if len(layers) > 1 else \
        f"BatchNorm in train mode ('{first}')"
    return ir.deferred(local, finish(layers), name=name, min_microbatch=DEFAULT_MIN_MICROBATCH,
                       why=why + ": batch statistics over fewer rows are noise")


def nest(parts: dict[str, torch.Tensor]) -> dict[str, Any]:
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
