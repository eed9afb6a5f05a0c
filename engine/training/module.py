"""The module bridge: an `nn.Module` becomes a pure `fn(variables, *batch)` and its variables tree.

    model = MyNet().eval()                        # or train mode: see "Dropout" and "What is refused" below
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

Batch arguments, the module and the loss (every batch argument is a tensor split along dim 0):
  - `inputs=n` (default 1): the first n batch arguments go to `forward` positionally.
  - `inputs=("input_ids", "attention_mask", "labels")`: they go to `forward` by these keyword names, in
    order (Hugging Face models take everything by keyword), and name the batch leaves in plans and errors.
  - `loss=None`: the module's own loss. A tensor result is the loss; a `ModelOutput` or dict result gives
    its `loss` field (transformers computes it when `labels` is among `inputs`); without one, ModuleError.
  - `loss=f`: the batch arguments after `inputs` are targets, and the loss is `f(out, *targets)`, with `out`
    the module's result, or `out[output]` with `output="logits"` (a ModelOutput / dict field).
The loss must be a mean over the batch (the engine's contract). Keywords over positions because that is
how transformers' `forward`s are called; a field name rather than an `output_fn` because it covers every
ModelOutput and names itself in errors, while `loss=lambda out, y: ...` stays for anything else.

Dropout (`rng=True`): train-mode dropout with p > 0 (nn.Dropout, F.dropout, attention dropout through
F.scaled_dot_product_attention(dropout_p=...)) draws from keys instead of PyTorch's global RNG. The
function takes one more, last, batch argument: `ir.row_keys(seed, batch_size)`, an int64 key per row
of the full batch (a new seed each step); `fn` runs the module under `ir.keyed_dropout(keys)` (ir/dropout.py).
Each element's mask is a hash of (its row's key, the dropout call, its place in the row), so a pipeline
of any schedule, stage count, microbatch count and dp computes exactly what one process computes on the
full batch with the same keys. The keys are a batch leaf, not a hidden step argument: the step stays a
pure function of what it is given, and each microbatch carries the keys of its own rows.

BatchNorm in train mode is state, as in Flax: `fn` then returns `(loss, {"buffers": new running
statistics})` (pass has_aux=True to parallelize; merge with `updated(variables, state)`), normalises each
microbatch with its own batch statistics and updates the running statistics as one full-batch forward
would, whatever the layout (engine/training/batchnorm.py says exactly how). `fn.forward(variables, *inputs)`
is the module's eval-mode forward (its outputs, not a loss): what `step.evaluate` runs on the same plan.

What is refused (ModuleError, at `functionalize` time or when the function is first traced/called):
  - Instance norm with track_running_stats in train mode (its running statistics are not supported).
  - Any other in-place write to a buffer (seen through the buffer's version counter).
  - Dropout (or attention dropout) with p > 0 in train mode without `rng=True`: PyTorch's dropout reads
    the global RNG. Dropout with p = 0 in train mode is the identity and is run as such.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.dropout import _DropoutNd

import ir

from ..errors import ModuleError
from . import batchnorm
from .batchnorm import updated
from .forward import eval_forward

__all__ = ["ModuleError", "check_module", "flat_names", "functionalize", "load_into", "updated"]

BN_FIX = ("put the norm layers in eval mode (model.eval() or bn.eval()), or use BatchNorm / GroupNorm / LayerNorm: "
          "a pure pipelined function cannot write running statistics; only BatchNorm's are carried as state")
DROPOUT_FIX = ("pass rng=True to functionalize and ir.row_keys(seed, batch_size) as the last batch argument "
               "(keyed dropout: the pipeline then equals one process with the same seed), or use p=0 or eval mode: "
               "PyTorch's dropout reads the global random state, which a pipelined pure function cannot")


def functionalize(module: nn.Module, loss: Callable[..., torch.Tensor] | None = None, *,
                  inputs: int | Sequence[str] = 1, output: str | None = None,
                  rng: bool = False) -> tuple[Callable[..., torch.Tensor], dict[str, dict]]:
    """`(fn, variables)`: `fn(variables, *batch)` runs `module` through `torch.func.functional_call`
    (then `loss(output, *targets)` if given); `variables = {"params": ..., "buffers": ...}` nested by
    module path. `inputs`: how many batch arguments go to the module positionally, or the names of
    `forward`'s keyword arguments they fill in order; `output`: the field of a `ModelOutput` / dict
    result handed to `loss`; `rng=True`: the last batch argument is `ir.row_keys(seed, batch_size)` and
    train-mode dropout draws from it. See the module docstring."""
    names = _input_names(inputs, loss)
    check_module(module, rng=rng)
    variables = {"params": _nest(module.named_parameters()), "buffers": _nest(module.named_buffers())}
    layers = batchnorm.train_layers(module)  # BatchNorm in train mode: its running statistics are state
    count = len(names) if names is not None else int(inputs)  # type: ignore[arg-type]

    def fn(variables: dict[str, dict], *batch: Any) -> torch.Tensor:
        params = dict(flat_names(variables["params"]))
        buffers = {k: v.detach() for k, v in flat_names(variables["buffers"])}
        versions = {k: v._version for k, v in buffers.items()}
        _check_count(len(batch), names, count, loss is not None, rng)
        batch, keys = (batch[:-1], batch[-1]) if rng else (batch, None)
        args, targets = (batch, ()) if loss is None and names is None else (batch[:count], batch[count:])
        call = (tuple(args), {}) if names is None else ((), dict(zip(names, args)))
        with _identity_dropouts(module), batchnorm.recording(layers) as stats, \
                (ir.keyed_dropout(keys) if rng else contextlib.nullcontext()):
            out = functional_call(module, {**params, **buffers}, call[0], call[1])
            value = _own_loss(module, out) if loss is None else loss(_field(module, out, output), *targets)
        changed = [k for k, v in buffers.items() if v._version != versions[k]]
        if changed:
            fix = BN_FIX if _has_bn(module) else "compute new tensors instead of writing into buffers"
            raise ModuleError(f"{type(module).__name__} wrote into buffer(s) {changed} in place; a pure "
                              f"function cannot carry that state: {fix}")
        return (value, batchnorm.nest(stats)) if layers else value

    fn.__name__ = f"{type(module).__name__}_loss"
    fn.__signature__ = _signature(loss, names, count, rng)  # type: ignore[attr-defined]  # names the batch leaves
    if layers:  # (loss, partial statistics) per microbatch, finished into running statistics per step
        fn = batchnorm.stateful(fn, layers, fn.__name__)
        fn.__signature__ = _signature(loss, names, count, rng)  # type: ignore[attr-defined]
    fn.forward = eval_forward(module, flat_names)  # type: ignore[attr-defined]  # what step.evaluate runs
    return fn, variables


def _input_names(inputs: int | Sequence[str], loss: Callable | None) -> tuple[str, ...] | None:
    """The keyword names of `inputs` (None for a count), checked."""
    if isinstance(inputs, str):
        raise ModuleError(f"inputs={inputs!r}: pass a tuple of names, e.g. inputs=({inputs!r},)")
    if isinstance(inputs, int):
        if loss is not None and inputs < 1:
            raise ModuleError(f"inputs={inputs}: the module needs at least one batch argument")
        return None
    names = tuple(inputs)
    if not names or not all(isinstance(n, str) and n.isidentifier() for n in names) or len(set(names)) < len(names):
        raise ModuleError(f"inputs={inputs!r}: give forward's keyword names, distinct, e.g. "
                          "('input_ids', 'attention_mask', 'labels')")
    return names


def _check_count(given: int, names: tuple[str, ...] | None, count: int, has_loss: bool, rng: bool) -> None:
    """ModuleError unless the batch has the module's inputs (exactly those when the module's own loss is
    taken by name), then any targets of `loss`, then the keys of `rng`."""
    need = (0 if names is None and not has_loss else count) + (1 if rng else 0)
    exact = names is not None and not has_loss
    if given == need or (given > need and not exact):
        return
    parts = [f"{count} for inputs {names or ''}".rstrip(), "then the loss's targets" if has_loss else "",
             "then ir.row_keys(seed, batch_size) last (rng=True)" if rng else ""]
    raise ModuleError(f"{'exactly' if exact else 'at least'} {need} batch arguments expected, got {given}: "
                      + ", ".join(p for p in parts if p))


def _field(module: nn.Module, out: Any, name: str | None) -> Any:
    """`out[name]` of a ModelOutput / dict result (or the result itself when `name` is None)."""
    if name is None:
        return out
    if isinstance(out, Mapping) and out.get(name) is not None:
        return out[name]
    have = list(out.keys()) if isinstance(out, Mapping) else type(out).__name__
    raise ModuleError(f"output={name!r}: {type(module).__name__} returned {have}; name one of its fields")


def _own_loss(module: nn.Module, out: Any) -> torch.Tensor:
    """The loss a module returns: a tensor, or the `loss` field of its ModelOutput / dict."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    have = list(out.keys()) if isinstance(out, Mapping) else type(out).__name__
    raise ModuleError(f"loss=None takes the module's own loss, but {type(module).__name__} returned {have} without "
                      "one: pass its labels among `inputs` (inputs=('input_ids', 'labels')), or a loss function, "
                      "e.g. loss=lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())")


def check_module(module: nn.Module, *, rng: bool = False) -> None:
    """Refuse modules that mutate buffers, or draw random numbers in their current mode without `rng`
    (ModuleError)."""
    for name, m in module.named_modules():
        where = f"'{name}' ({type(m).__name__})" if name else type(m).__name__
        if isinstance(m, _NormBase) and not isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
            raise ModuleError(f"{where} is in train mode: {BN_FIX}")
        if rng:
            continue
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


def _signature(loss: Callable | None, names: tuple[str, ...] | None, count: int, rng: bool) -> inspect.Signature:
    """`(variables, x, *y)`, `(variables, input_ids, attention_mask, *y, rng)`...: the engine names batch
    leaves by these (`x`, `y`, then `arg3`...)."""
    kind = inspect.Parameter.POSITIONAL_ONLY
    if names is not None:
        firsts, rest = list(names), "y"
    elif loss is None:
        firsts, rest = [], "x"
    else:
        firsts, rest = (["x"] if count == 1 else [f"x{i}" for i in range(count)]), "y"
    params = [inspect.Parameter(n, kind) for n in ("variables", *firsts)]
    if rng:  # a VAR_POSITIONAL cannot come before it: the targets are named y0, y1...
        return inspect.Signature([*params, inspect.Parameter("rng", kind)] if loss is None else
                                 [*params, inspect.Parameter("y", kind), inspect.Parameter("rng", kind)])
    return inspect.Signature([*params, inspect.Parameter(rest, inspect.Parameter.VAR_POSITIONAL)])
