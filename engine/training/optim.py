"""Pure functional optimizers over param trees, gradient accumulation, and global-norm clipping.

    params = step.shard(params)                   # this rank's leaves; None elsewhere
    state = None
    for x, y in loader:
        loss, grads = step(params, x, y)
        grads, norm = engine.optim.clip_grad_norm(grads, 1.0, step=step)   # norm over every rank
        params, state = engine.optim.adamw(params, grads, state, lr=1e-3)

Every function takes and returns trees with the params' structure; a None leaf (not on this rank, or
no gradient) is skipped: its param and state come back as the very objects passed in. `sgd` and
`adamw` are pure: they never write to params, grads or state, and every updated leaf comes back as a
new tensor (so each step allocates new params and state where torch.optim updates in place; the old
ones are freed when the caller drops them). They run torch's own kernels over the local leaves, grouped
by device and dtype as torch.optim groups them (engine/training/optim_kernels.py): contiguous float32 /
float64 leaves through the fused kernel (one pass over memory, on copies made by one foreach call), the
rest through the foreach kernels made out of place. Each leaf equals `torch.optim.SGD` / `AdamW`
stepping the same tensor with the kernel it took, `fused=True` or `foreach=True`, bit for bit;
`fused=False` takes foreach for every leaf. The step count is the tree's (`state["step"]`): a leaf
that had no grad for some steps is bias-corrected with it, where torch.optim counts per tensor.
The state is a dict of plain values and trees of tensors
(`{"step": 3, "exp_avg": <tree>, "exp_avg_sq": <tree>}`), so `engine.checkpoint` saves it by leaf
name: a state leaf whose key path ends with a param's name (`exp_avg.blocks.3.w_q`) lives where
that param lives.

Gradient accumulation over k steps keeps the mean contract only if divided by k:

    acc = None
    for x, y in chunks:                           # k chunks of one logical batch
        _, grads = step(params, x, y)
        acc = engine.optim.accumulate(acc, grads)
    params, state = engine.optim.sgd(params, engine.optim.scale(acc, 1 / k), state, lr=0.1)

ZeRO-1 (a step planned with `shard_optimizer=True`): `ShardedOptimizer(step, adamw, lr=..., max_norm=...)`
sums the grads over each stage's dp replicas, clips, and steps 1/dp of every leaf (engine/training/zero.py).

torch.optim works too, on the local leaves (they are plain detached tensors):

    local = engine.optim.local_leaves(params)      # this rank's tensors, in tree order
    opt = torch.optim.AdamW(local, lr=1e-3)
    loss, grads = step(params, x, y)
    engine.optim.set_grads(params, grads)         # leaf.grad = its gradient
    opt.step()                                    # updates the leaves of `params` in place
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ir.trace import key_name

from ..errors import EngineError
from . import optim_kernels
from .zero import ShardedOptimizer

__all__ = ["ShardedOptimizer", "accumulate", "adamw", "clip_grad_norm", "local_leaves", "owned_leaves", "scale",
           "set_grads", "sgd"]

_is_none = lambda x: x is None  # noqa: E731 -- None is a leaf of our trees, not an empty node


def _leaves(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    return pytree.tree_flatten(tree, is_leaf=_is_none)


def _check_same(params: Any, grads: Any, what: str = "grads") -> tuple[list[Any], list[Any], pytree.TreeSpec]:
    p, spec = _leaves(params)
    g, gspec = _leaves(grads)
    if spec != gspec:
        raise EngineError(f"{what} tree does not match params tree:\n  params {spec}\n  {what} {gspec}\n"
                          "pass the trees returned by step.shard(params) and step(...)")
    return p, g, spec


def _state_tree(state: dict | None, key: str, spec: pytree.TreeSpec, n: int) -> list[Any]:
    if state is None:
        return [None] * n
    leaves, sspec = _leaves(state[key])
    if sspec != spec:
        raise EngineError(f"optimizer state '{key}' has another tree than params: {sspec} vs {spec}; "
                          "pass the state this optimizer returned for these params")
    return leaves


def _leaf_namer(tree: Any) -> Callable[[int], str]:
    """The key path name of flat leaf i (`blocks.3.w_q`), worked out only when an error needs it."""
    return lambda i: key_name(pytree.tree_flatten_with_path(tree, is_leaf=_is_none)[0][i][0])


@torch.no_grad()
def sgd(params: Any, grads: Any, state: dict | None = None, *, lr: float, momentum: float = 0.0,
        dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
        fused: bool | None = None) -> tuple[Any, dict]:
    """One SGD step (torch.optim.SGD's update): returns new params and state `{"step", "momentum"}`.

    `fused`: None (default) steps contiguous float32 / float64 leaves with torch's fused kernel (equal to
    SGD(fused=True)) and the rest with its foreach kernels (equal to SGD(foreach=True)); False foreach
    for all; True fused for every contiguous leaf, raising for a leaf whose device and dtype have no
    fused kernel here (bfloat16 / float16 on CPU)."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise EngineError(f"nesterov needs momentum > 0 and dampening 0 (got {momentum}, {dampening})")
    p_leaves, g_leaves, spec = _check_same(params, grads)
    bufs = _state_tree(state, "momentum", spec, len(p_leaves))
    new_p, new_b = list(p_leaves), list(bufs)
    for group in optim_kernels.split(p_leaves, g_leaves, [bufs], fused=fused, opt="SGD", name=_leaf_namer(params)):
        ix = group.index
        ps, bs = optim_kernels.sgd([p_leaves[i] for i in ix], [g_leaves[i] for i in ix], [bufs[i] for i in ix],
                                   fused=group.fused, lr=lr, momentum=momentum, dampening=dampening,
                                   weight_decay=weight_decay, nesterov=nesterov)
        for i, p, b in zip(ix, ps, bs):
            new_p[i], new_b[i] = p, b
    step = (state or {}).get("step", 0) + 1
    return pytree.tree_unflatten(new_p, spec), {"step": step, "momentum": pytree.tree_unflatten(new_b, spec)}


@torch.no_grad()
def adamw(params: Any, grads: Any, state: dict | None = None, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 0.01, fused: bool | None = None) -> tuple[Any, dict]:
    """One AdamW step (torch.optim.AdamW's update): new params and state `{"step", "exp_avg", "exp_avg_sq"}`.

    `fused` as in `sgd`. The fused and foreach paths round differently in float32, and on CUDA the fused
    kernel computes the bias corrections in float32 for float32 leaves (about 1e-4 off in the first steps
    when beta2 is near 1): fused=False gives torch.optim's default numbers."""
    beta1, beta2 = betas
    p_leaves, g_leaves, spec = _check_same(params, grads)
    m_leaves = _state_tree(state, "exp_avg", spec, len(p_leaves))
    v_leaves = _state_tree(state, "exp_avg_sq", spec, len(p_leaves))
    step = (state or {}).get("step", 0) + 1
    new_p, new_m, new_v = list(p_leaves), list(m_leaves), list(v_leaves)
    groups = optim_kernels.split(p_leaves, g_leaves, [m_leaves, v_leaves], fused=fused, opt="AdamW",
                                 name=_leaf_namer(params))
    for group in groups:
        ix = group.index
        ps, ms, vs = optim_kernels.adamw(
            [p_leaves[i] for i in ix], [g_leaves[i] for i in ix], [m_leaves[i] for i in ix],
            [v_leaves[i] for i in ix], fused=group.fused, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay)
        for i, p, m, v in zip(ix, ps, ms, vs):
            new_p[i], new_m[i], new_v[i] = p, m, v
    unflat = lambda xs: pytree.tree_unflatten(xs, spec)  # noqa: E731
    return unflat(new_p), {"step": step, "exp_avg": unflat(new_m), "exp_avg_sq": unflat(new_v)}


def _zip_map(f: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    a_leaves, b_leaves, spec = _check_same(a, b, "second")
    return pytree.tree_unflatten([f(x, y) for x, y in zip(a_leaves, b_leaves)], spec)


def accumulate(grads_a: Any, grads_b: Any) -> Any:
    """Leafwise sum of two grad trees (None + g = g); `grads_a` may be None to start a loop.
    After k accumulated steps, `scale(acc, 1 / k)` keeps grads the mean over all k batches."""
    if grads_a is None:
        return grads_b
    return _zip_map(lambda x, y: y if x is None else x if y is None else x + y, grads_a, grads_b)


def scale(grads: Any, factor: float) -> Any:
    """Every non-None leaf times `factor`."""
    leaves, spec = _leaves(grads)
    return pytree.tree_unflatten([None if g is None else g * factor for g in leaves], spec)


def owned_leaves(step: Any) -> list[int]:
    """Flat leaf indices this rank owns: of the world ranks holding a leaf (every stage using it, in
    every replica) the lowest owns it, so a tied or replicated leaf is counted once over the job."""
    owner: dict[int, int] = {}
    for info in step.infos:
        pos = step.table.rank_of(info.stage.index)  # replica 0 holds world rank == position
        for pid in info.stage.param_ids:
            owner[pid] = min(owner.get(pid, pos), pos)
    return sorted(pid for pid, r in owner.items() if r == step.world.rank)


def clip_grad_norm(grads: Any, max_norm: float, *, step: Any = None, eps: float = 1e-6) -> tuple[Any, torch.Tensor]:
    """`(grads * min(1, max_norm / (norm + eps)), norm)` with `norm` the L2 norm of the whole model's
    grads, as `torch.nn.utils.clip_grad_norm_` computes it on one process.

    With `step` (needed when world > 1) each leaf's norm² is counted once, on the lowest world rank that
    holds it, and summed over all ranks; every rank gets the same `norm` and scale."""
    leaves, spec = _leaves(grads)
    if step is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise EngineError("clip_grad_norm on several ranks needs step=<the Step> to count each leaf once "
                              "(leaves are split over stages and copied over dp replicas)")
        mine = [g for g in leaves if g is not None]
    elif getattr(step.plan, "shard_optimizer", False) and step.plan.dp > 1:
        raise EngineError("this step was planned with shard_optimizer=True: its grads are each replica's part, "
                          "summed over dp only by the sharded optimizer; clip there: "
                          "engine.optim.ShardedOptimizer(step, engine.optim.adamw, max_norm=1.0, lr=...)")
    else:
        mine = [leaves[pid] for pid in owned_leaves(step) if leaves[pid] is not None]
    present = [g for g in leaves if g is not None]
    device = present[0].device if present else getattr(getattr(step, "world", None), "device", torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in mine:
        sq += torch.linalg.vector_norm(g, 2).to(torch.float64) ** 2
    if step is not None and step.world.size > 1:
        step.transport.all_reduce(sq, tuple(range(step.world.size)))
    dtype = present[0].dtype if present else torch.float32
    norm = sq.sqrt().to(dtype)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    return pytree.tree_unflatten([None if g is None else g * coef.to(g.device) for g in leaves], spec), norm


def local_leaves(params: Any) -> list[torch.Tensor]:
    """This rank's tensors of a sharded tree, in tree order (for torch.optim)."""
    return [x for x in _leaves(params)[0] if x is not None]


def set_grads(params: Any, grads: Any) -> None:
    """`leaf.grad = grad` for every local leaf (None grads clear it), so a torch.optim optimizer can step."""
    for p, g in zip(*_check_same(params, grads)[:2]):
        if p is not None:
            p.grad = g
