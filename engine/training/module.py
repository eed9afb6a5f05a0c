"""The module bridge: an `nn.Module` becomes a pure `fn(variables, *batch)` and its variables tree.

    model = MyNet().eval()                        # or train mode: see "What is refused" below
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    step = engine.parallelize(fn, variables, x, y)
    variables = step.shard(variables)
    loss, grads = step(variables, x, y)
    variables["params"], state = engine.optim.adamw(variables["params"], grads["params"], state, lr=1e-3)
    engine.module.load_into(model, step.gather(variables))   # back into the module (rank 0)

`variables` is `{"params": ..., "buffers": ...}` (flax's collections): each a nested dict by module path,
so leaf names are `params.encoder.layers.0.linear1.weight` and `buffers.bn.running_mean`. Leaves are
the module's own tensors, detached (no copy). Tied parameters appear once, under their first name.

Buffers are inputs of the function but constants for autodiff: `fn` detaches them, so their grads are
zero (`torch.func.grad`) and zero or None (the pipeline). Give the optimizer `variables["params"]` and
`grads["params"]` only, so buffers are never updated (weight decay would otherwise shrink them).
`torch.func.grad` cannot differentiate integer leaves (`num_batches_tracked`): take the reference grad
with respect to `variables["params"]`, closing over the buffers.

`loss(output, *targets) -> scalar` must be a mean over the batch (the engine's contract); with
`inputs=n` the first n batch arguments go to the module and the rest to `loss`. With `loss=None` the
module's output is the loss and every batch argument goes to the module.

BatchNorm in train mode is state, as in Flax: `fn` then returns `(loss, {"buffers": new running
statistics})` (pass has_aux=True to parallelize; merge with `updated(variables, state)`), normalises each
microbatch with its own batch statistics and updates the running statistics as one full-batch forward
would, whatever the layout (engine/training/batchnorm.py says exactly how). `fn.forward(variables, *inputs)`
is the module's eval-mode forward (its outputs, not a loss): what `step.evaluate` runs on the same plan.

What is refused (ModuleError, at `functionalize` time or when the function is first traced/called):
  - Instance norm with track_running_stats in train mode (its running statistics are not supported).
  - Any other in-place write to a buffer (seen through the buffer's version counter).
  - Dropout (or attention dropout) with p > 0 in train mode: PyTorch's dropout reads the global RNG.
    Use p = 0 or eval mode, or `ir.random.dropout(x, p, key)` with the key in the batch. Dropout with
    p = 0 in train mode is the identity and is run as such.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.dropout import _DropoutNd

from ..errors import ModuleError
from . import batchnorm
from .batchnorm import updated
from .forward import eval_forward

__all__ = ["ModuleError", "check_module", "flat_names", "functionalize", "load_into", "updated"]

BN_FIX = ("put the norm layers in eval mode (model.eval() or bn.eval()), or use BatchNorm / GroupNorm / LayerNorm: "
          "a pure pipelined function cannot write running statistics; only BatchNorm's are carried as state")
DROPOUT_FIX = ("use p=0 or eval mode, or ir.random.dropout(x, p, key) with `key` an int64 tensor in the batch: "
               "PyTorch's dropout reads the global random state, which a pipelined pure function cannot")


def functionalize(module: nn.Module, loss: Callable[..., torch.Tensor] | None = None, *,
                  inputs: int = 1) -> tuple[Callable[..., torch.Tensor], dict[str, dict]]:
    """`(fn, variables)`: `fn(variables, *batch)` runs `module` through `torch.func.functional_call`
    (then `loss(output, *targets)` if given); `variables = {"params": ..., "buffers": ...}` nested by
    module path. See the module docstring for buffers and what is refused."""
    if loss is not None and inputs < 1:
        raise ModuleError(f"inputs={inputs}: the module needs at least one batch argument")
    check_module(module)
    variables = {"params": _nest(module.named_parameters()), "buffers": _nest(module.named_buffers())}
    layers = batchnorm.train_layers(module)  # BatchNorm in train mode: its running statistics are state

    def fn(variables: dict[str, dict], *batch: Any) -> torch.Tensor:
        params = dict(flat_names(variables["params"]))
        buffers = {k: v.detach() for k, v in flat_names(variables["buffers"])}
        versions = {k: v._version for k, v in buffers.items()}
        args, targets = (batch, ()) if loss is None else (batch[:inputs], batch[inputs:])
        with _identity_dropouts(module), batchnorm.recording(layers) as stats:
            out = functional_call(module, {**params, **buffers}, tuple(args))
        changed = [k for k, v in buffers.items() if v._version != versions[k]]
        if changed:
            fix = BN_FIX if _has_bn(module) else "compute new tensors instead of writing into buffers"
            raise ModuleError(f"{type(module).__name__} wrote into buffer(s) {changed} in place; a pure "
                              f"function cannot carry that state: {fix}")
        value = out if loss is None else loss(out, *targets)
        return (value, batchnorm.nest(stats)) if layers else value

    fn.__name__ = f"{type(module).__name__}_loss"
    fn.__signature__ = _signature(loss, inputs)  # type: ignore[attr-defined]  # names the batch leaves
    if layers:  # (loss, partial statistics) per microbatch, finished into running statistics per step
        fn = batchnorm.stateful(fn, layers, fn.__name__)
        fn.__signature__ = _signature(loss, inputs)  # type: ignore[attr-defined]
    fn.forward = eval_forward(module, flat_names)  # type: ignore[attr-defined]  # what step.evaluate runs
    return fn, variables


def check_module(module: nn.Module) -> None:
    """Refuse modules that mutate buffers or draw random numbers in their current mode (ModuleError)."""
    for name, m in module.named_modules():
        where = f"'{name}' ({type(m).__name__})" if name else type(m).__name__
        if isinstance(m, _NormBase) and not isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
            raise ModuleError(f"{where} is in train mode: {BN_FIX}")
        if isinstance(m, _DropoutNd) and m.training and m.p > 0:
            raise ModuleError(f"{where} has dropout p={m.p} in train mode: {DROPOUT_FIX}")
        if isinstance(m, nn.MultiheadAttention) and m.training and m.dropout > 0:
            raise ModuleError(f"{where} has attention dropout {m.dropout} in train mode: {DROPOUT_FIX}")


def flat_names(tree: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted module path, tensor) for every leaf of a nested dict such as `variables["params"]`."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from ((f"{key}.{k}", v) for k, v in flat_names(value))
        else:
            yield key, value


def load_into(module: nn.Module, variables: dict[str, dict]) -> None:
    """Copy a full variables tree (e.g. `step.gather(variables)` on rank 0) into the module's tensors."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, value in (*flat_names(variables["params"]), *flat_names(variables["buffers"])):
        if name not in own:
            raise ModuleError(f"variables have '{name}', which {type(module).__name__} does not; "
                              "load the tree made by functionalize() of this module class")
        if value is None:
            raise ModuleError(f"'{name}' is None: pass the full tree (step.gather(variables) on rank 0)")
        with torch.no_grad():
            own[name].copy_(value)


def _nest(named: Iterator[tuple[str, torch.Tensor]]) -> dict:
    root: dict = {}
    for name, t in named:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = t.detach()
    return root


def _has_bn(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())


@contextlib.contextmanager
def _identity_dropouts(module: nn.Module) -> Iterator[None]:
    """Dropout with p = 0 in train mode still emits an RNG op; eval mode makes it the identity it is."""
    flipped = [m for m in module.modules() if isinstance(m, _DropoutNd) and m.training and m.p == 0]
    for m in flipped:
        m.training = False
    try:
        yield
    finally:
        for m in flipped:
            m.training = True


def _signature(loss: Callable | None, inputs: int) -> inspect.Signature:
    """`(variables, x, *y)`: the engine names batch leaves by these (`x`, `y`, then `arg3`...)."""
    kind = inspect.Parameter.POSITIONAL_ONLY
    if loss is None:
        names, rest = [], "x"
    else:
        names, rest = (["x"] if inputs == 1 else [f"x{i}" for i in range(inputs)]), "y"
    params = [inspect.Parameter(n, kind) for n in ("variables", *names)]
    return inspect.Signature([*params, inspect.Parameter(rest, inspect.Parameter.VAR_POSITIONAL)])
