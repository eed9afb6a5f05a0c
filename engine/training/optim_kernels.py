"""The arithmetic of `engine.optim.sgd` / `adamw` on flat lists of one device and dtype, through torch's fused
or foreach kernels, never writing to a tensor it was given.

torch.optim updates its tensors in place; a pure step must return new ones. The foreach path is
`torch.optim`'s `_multi_tensor_sgd` / `_multi_tensor_adam` with each first in-place op made out of place, so
its numbers equal `torch.optim.SGD` / `AdamW(foreach=True)` bit for bit. The fused path copies params and
state with one foreach copy and runs torch's fused kernel on the copies (one pass over memory
instead of about eight): its numbers equal `torch.optim.SGD` / `AdamW(fused=True)`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch

from ..errors import EngineError

Tensors = list[torch.Tensor]
# dtypes whose fused kernels are exact and tested, per device type. Not bfloat16 / float16 on CPU: torch
# 2.13's CPU fused SGD is wrong there (27% off on a 30x40 bfloat16 leaf in one step).
FUSED_DTYPES = {"cpu": (torch.float32, torch.float64),
                "cuda": (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
# what fused=None picks: float32/float64 only, so low-precision leaves keep torch.optim's default
# (foreach) rounding op for op; their fused kernels compute in float32 and round once
AUTO_FUSED_DTYPES = (torch.float32, torch.float64)
FOREACH_CLONE = getattr(torch, "_foreach_clone", None)  # torch 2.13 has it, 2.11 not

NO_FUSED_KERNEL = ("leaf '{name}' ({dtype} on {device}) has no fused {opt} kernel here (fused kernels: {table}); "
                   "pass fused=None to use them where they exist and foreach kernels elsewhere, or fused=False")
MISMATCH = ("grad of leaf '{name}' is {g}, its param is {p}; pass grads from step(params, ...) for these params "
            "(cast a grad with .to(param.dtype) if the loss function made it in another dtype)")


@attrs.frozen
class Group:
    """Leaves stepped together: one device and dtype, one kernel family. `index`: positions in the tree."""

    device: torch.device
    dtype: torch.dtype
    fused: bool
    index: tuple[int, ...]


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype}{list(x.shape)} on {x.device}"


def split(params: Sequence[Any], grads: Sequence[Any], states: Sequence[Sequence[Any]], *, fused: bool | None,
          opt: str, name: Callable[[int], str]) -> list[Group]:
    """Groups of the leaves with both a param and a grad, by device, dtype and kernel (as torch.optim groups).

    A leaf goes fused when `fused` is not False, the kernel exists for its device and dtype (fused=None:
    float32 / float64 only) and param, grad and state are contiguous: the fused kernels walk raw memory,
    so a transposed view would pair the wrong elements (torch.optim's CPU fused step gets it wrong).
    The loop runs for every leaf of every step, so it reads each attribute once."""
    found: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    kernel: dict[tuple[torch.device, torch.dtype], bool] = {}  # device.type costs 0.4 us: once per group
    per_leaf_state = list(zip(*states)) if states else [()] * len(params)
    for i, (p, g, state) in enumerate(zip(params, grads, per_leaf_state)):
        if p is None or g is None:
            continue
        device, dtype = p.device, p.dtype
        if g.dtype != dtype or g.device != device or g.shape != p.shape:
            raise EngineError(MISMATCH.format(name=name(i), g=_describe(g), p=_describe(p)))
        go = kernel.get((device, dtype))
        if go is None:
            go = kernel[device, dtype] = _has_kernel(device, dtype, fused, opt, lambda i=i: name(i))
        if go and not (p.is_contiguous() and g.is_contiguous()):
            go = False
        for s in state if go else ():
            if s is not None and not s.is_contiguous():
                go = False
        found.setdefault((device, dtype, go), []).append(i)
    return [Group(d, t, f, tuple(ix)) for (d, t, f), ix in found.items()]


def _has_kernel(device: torch.device, dtype: torch.dtype, fused: bool | None, opt: str,
                name: Callable[[], str]) -> bool:
    """Whether leaves of this device and dtype go fused (contiguity aside); fused=True raises if they can't."""
    exists = dtype in FUSED_DTYPES.get(device.type, ())
    if fused and not exists:
        table = {k: [str(d).removeprefix("torch.") for d in v] for k, v in FUSED_DTYPES.items()}
        raise EngineError(NO_FUSED_KERNEL.format(name=name(), dtype=dtype, device=device, opt=opt, table=table))
    return exists and (fused is True or (fused is None and dtype in AUTO_FUSED_DTYPES))


def clone(xs: list[torch.Tensor]) -> Tensors:
    """New tensors equal to `xs`, strides kept where dense, by one foreach call. On CUDA `xs * 1` (exact): one
    multi-tensor kernel whose outputs are allocated in C++, where a clone or `empty_like` per leaf costs a
    Python call each. On CPU `torch._foreach_clone`, or on torch 2.11, which lacks it, fresh tensors filled
    by one `torch._foreach_copy_` (both faster there than `xs * 1`, which runs one op per leaf)."""
    if not xs:
        return []
    if xs[0].is_cuda:
        return list(torch._foreach_mul(xs, 1.0))
    if FOREACH_CLONE is not None:
        return list(FOREACH_CLONE(xs))
    out = [torch.empty_like(x) for x in xs]
    torch._foreach_copy_(out, xs)
    return out


def _copies(*lists: Sequence[Any]) -> list[Tensors]:
    """Each list with its tensors copied by one foreach call over all of them; None stays None."""
    joined = [x for xs in lists for x in xs]
    if all(x is not None for x in joined):  # every step after the first: no Python loop over the copies
        made, out, at = clone(joined), [], 0
        for xs in lists:
            out.append(made[at:at + len(xs)])
            at += len(xs)
        return out
    it = iter(clone([x for x in joined if x is not None]))
    return [[None if x is None else next(it) for x in xs] for xs in lists]


def _zeros_where_none(xs: Sequence[Any], like: Tensors) -> Tensors:
    return [torch.zeros_like(p) if x is None else x for x, p in zip(xs, like)]


def adamw(params: Tensors, grads: Tensors, exp_avgs: Sequence[Any], exp_avg_sqs: Sequence[Any], *, fused: bool,
          step: int, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float) -> tuple[Tensors, Tensors, Tensors]:
    """New (params, exp_avgs, exp_avg_sqs) after AdamW step number `step`; None state starts at zero."""
    if fused:
        new_p, new_m, new_v = _copies(params, exp_avgs, exp_avg_sqs)
        new_m, new_v = _zeros_where_none(new_m, params), _zeros_where_none(new_v, params)
        # made on the device by a fill kernel: torch.tensor(step, device=cuda) would wait for the GPU
        steps = [torch.full((), float(step), dtype=torch.float32, device=params[0].device)] * len(params)
        torch._fused_adamw_(new_p, grads, new_m, new_v, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return new_p, new_m, new_v
    # torch.optim's rounding of the step constants: Python floats, as _multi_tensor_adam computes them, passed
    # as one per leaf as it passes them: on CUDA `_foreach_div_` by a single scalar multiplies by its
    # reciprocal, which rounds differently from dividing by a list of scalars
    n = len(params)
    step_sizes, bias2_sqrt = [(lr / (1 - beta1 ** step)) * -1] * n, [(1 - beta2 ** step) ** 0.5] * n
    new_m = torch._foreach_lerp(_zeros_where_none(exp_avgs, params), grads, 1 - beta1)
    new_v = _times(_zeros_where_none(exp_avg_sqs, params), beta2)
    torch._foreach_addcmul_(new_v, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(new_v)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, eps)
    if weight_decay != 0:
        new_p = _times(params, 1 - lr * weight_decay)
        torch._foreach_addcdiv_(new_p, new_m, denom, step_sizes)
    else:
        new_p = list(torch._foreach_addcdiv(params, new_m, denom, step_sizes))
    return new_p, list(new_m), new_v


def _times(xs: Sequence[torch.Tensor], c: float) -> Tensors:
    """`xs * c` in new tensors, rounded as torch.optim's in-place `_foreach_mul_` rounds. That op rounds `c` to
    a float16 / bfloat16 leaf's dtype first (torch 2.13, CPU), `_foreach_mul` does not: a copy and the
    in-place op keep those leaves equal to torch.optim bit for bit; float32 / float64 need no copy."""
    if not xs or xs[0].dtype in AUTO_FUSED_DTYPES:
        return list(torch._foreach_mul(list(xs), c))
    out = clone(list(xs))
    torch._foreach_mul_(out, c)
    return out


def sgd(params: Tensors, grads: Tensors, bufs: Sequence[Any], *, fused: bool, lr: float, momentum: float,
        dampening: float, weight_decay: float, nesterov: bool) -> tuple[Tensors, list[Any]]:
    """New (params, momentum buffers) after one SGD step; a None buffer starts as the first step's grad."""
    if fused:
        return _fused_sgd(params, grads, bufs, lr=lr, momentum=momentum, dampening=dampening,
                          weight_decay=weight_decay, nesterov=nesterov)
    d = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay != 0 else grads
    new_b = list(bufs)
    if momentum != 0:
        have = [i for i, b in enumerate(bufs) if b is not None]
        new = [i for i, b in enumerate(bufs) if b is None]
        if have:
            moved = _times([bufs[i] for i in have], momentum)
            torch._foreach_add_(moved, [d[i] for i in have], alpha=1 - dampening)
            for i, b in zip(have, moved):
                new_b[i] = b
        for i, b in zip(new, clone([d[i] for i in new])):
            new_b[i] = b
        d = torch._foreach_add(d, new_b, alpha=momentum) if nesterov else new_b
    return torch._foreach_add(params, d, alpha=-lr), new_b


def _fused_sgd(params: Tensors, grads: Tensors, bufs: Sequence[Any], *, lr: float, momentum: float,
               dampening: float, weight_decay: float, nesterov: bool) -> tuple[Tensors, list[Any]]:
    new_p, new_b = _copies(params, bufs if momentum != 0 else [])
    kw = dict(weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
              maximize=False)
    if momentum == 0:
        torch._fused_sgd_(new_p, grads, [], is_first_step=False, **kw)
        return new_p, list(bufs)
    # the kernel takes one is_first_step for all its leaves: a leaf without a buffer yet (its first grad)
    # goes in a call of its own, whose kernel sets the buffer to that grad as torch.optim does
    for first in (False, True):
        ix = [i for i, b in enumerate(new_b) if (b is None) == first]
        if not ix:
            continue
        if first:
            for i in ix:
                new_b[i] = torch.empty_like(params[i])
        torch._fused_sgd_([new_p[i] for i in ix], [grads[i] for i in ix], [new_b[i] for i in ix],
                          is_first_step=first, **kw)
    return new_p, new_b
