"""ZeRO-1: the optimizer state of each stage split over its dp replicas (`ShardedOptimizer`).

    step = engine.parallelize(loss_fn, params, x, y, dp=4, shard_optimizer=True)
    params = step.shard(params)
    opt = engine.optim.ShardedOptimizer(step, engine.optim.adamw, lr=1e-3, max_norm=1.0)
    state = None
    for x, y in loader:
        loss, grads = step(params, x, y)          # grads: this replica's part, not yet summed over dp
        params, state = opt(params, grads, state)  # reduce-scatter, clip, step 1/dp, all-gather

What it does, per pipeline position q and its dp group (world ranks q, q + p, q + 2p, ...):
- The step's program sums grads only within its replica (tied stages); `reduce_scatter` sums them over
  the dp group and leaves replica d with slice d of every local leaf (a leaf's flat view cut into dp
  chunks of ceil(numel / dp), the last zero-padded), one collective per dtype.
- `clip_grad_norm` takes the L2 norm over every element once: each replica's slices are disjoint and a
  leaf tied over stages is counted at its lowest position only; one all-reduce over the world.
- The wrapped optimizer (`engine.optim.sgd`, `adamw`, or any pure `(params, grads, state, **kw) ->
  (params, state)` over trees) steps the slices: these optimizers are elementwise, so a slice's update
  equals that slice of the whole leaf's, and their state holds 1/dp of each leaf.
- `all_gather` puts the updated slices together again: every replica holds the whole new params.

Why slices of every leaf rather than whole leaves dealt out to replicas (DeepSpeed's flat partition, or
Megatron's buffer ranges): the state stays a tree with the params' names, every replica holds the same
share whatever the leaf sizes, and checkpoints stay per leaf. Why the communication is reduce-scatter +
all-gather: together they move the bytes of the all-reduce they replace (a ring all-reduce is exactly
these two), so ZeRO-1 costs no bandwidth. A leaf tied over two positions is reduced and stepped by
both positions' groups alike: it is reduce-scattered alone (same buffer layout in every group, so
the same sums in the same order) and stepped from the same values, so its copies stay bit-identical.

Checkpoints: `full_state(state)` gathers the slices back into whole leaves (the tree `engine.optim`
would have made without sharding: `engine.checkpoint.save` writes it as always), and
`shard_state(full)` cuts a loaded one for this rank, so a checkpoint loads onto any dp degree or plan:

    engine.checkpoint.save(path, step, params, opt.full_state(state))
    params, full = engine.checkpoint.load(path, step, params)
    state = opt.shard_state(full)
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..errors import EngineError

__all__ = ["ShardedOptimizer"]

_is_none = lambda x: x is None  # noqa: E731
BUCKET_BYTES = 256 * 2**20  # grads summed per collective: bounds the transient copy, keeps collectives few

NOT_SHARDED = ("engine.optim.ShardedOptimizer needs a step planned with ZeRO-1: "
               "engine.parallelize(..., shard_optimizer=True) (its plan says plan.shard_optimizer)")


class ShardedOptimizer:
    """ZeRO-1 around a pure optimizer (see the module docstring). `hyper`: the optimizer's keywords;
    `max_norm`: clip the global grad norm first (as engine.optim.clip_grad_norm; `self.norm` keeps it)."""

    def __init__(self, step: Any, update: Callable[..., tuple[Any, Any]], *, max_norm: float | None = None,
                 **hyper: Any) -> None:
        if step.plan.dp > 1 and not getattr(step.plan, "shard_optimizer", False):  # dp 1: nothing to split
            raise EngineError(NOT_SHARDED)
        self.step, self.update, self.max_norm, self.hyper = step, update, max_norm, hyper
        p, self.dp = step.plan.pipeline_depth, step.plan.dp
        self.replica, position = divmod(step.world.rank, p)
        self.group = tuple(d * p + position for d in range(self.dp))
        self.local = list(step.local_params)
        avals = [step.graph.inputs[pid].aval for pid in self.local]
        self.shapes = {pid: tuple(a.shape) for pid, a in zip(self.local, avals)}
        self.chunk = {pid: math.ceil(max(a.numel, 1) / self.dp) for pid, a in zip(self.local, avals)}
        self.owned = set(_owned_here(step, position))
        self.tied = set(_tied(step))
        self.norm: torch.Tensor | None = None

    def __call__(self, params: Any, grads: Any, state: Any = None) -> tuple[Any, Any]:
        """One step: `(new params, new state)`; params whole on every replica, state this replica's slices."""
        shards = self.reduce_scatter(grads)
        if self.max_norm is not None:
            shards, self.norm = self.clip_grad_norm(shards, self.max_norm)
        new, state = self.update(self.shard(params), shards, state, **self.hyper)
        return self.all_gather(new, params), state

    # -- the pieces, for a loop that wants them apart --------------------------------------------------
    def reduce_scatter(self, grads: Any) -> Any:
        """grads (this replica's part of each local leaf) -> this replica's slice of the dp sum, per leaf."""
        leaves, spec = self._tree(grads, "grads")
        out: list[Any] = [None] * len(leaves)
        for pids in self._by_dtype(leaves):
            parts = [self._padded(leaves[pid]).view(self.dp, self.chunk[pid]) for pid in pids]
            flat = torch.cat(parts, dim=1).reshape(-1) if len(parts) > 1 else parts[0].reshape(-1)
            mine = self._reduce_scatter(flat)
            for pid, piece in zip(pids, torch.split(mine, [self.chunk[pid] for pid in pids])):
                out[pid] = piece
        return pytree.tree_unflatten(out, spec)

    def shard(self, tree: Any) -> Any:
        """A tree of whole local leaves -> this replica's slice of each (flat, zero-padded at the end)."""
        leaves, spec = self._tree(tree, "params")
        out = [self._slice(x, pid) if pid in self.chunk and x is not None else None for pid, x in enumerate(leaves)]
        return pytree.tree_unflatten(out, spec)

    def all_gather(self, shards: Any, like: Any) -> Any:
        """Slices from every replica -> whole leaves shaped (and typed) as the leaves of `like`."""
        leaves, spec = self._tree(shards, "shards")
        ref = pytree.tree_flatten(like, is_leaf=_is_none)[0]
        out: list[Any] = [None] * len(leaves)
        for pids in self._by_dtype(leaves):
            mine = torch.cat([leaves[pid].reshape(-1) for pid in pids])
            whole = self._all_gather(mine).view(self.dp, -1)
            for pid, cols in zip(pids, torch.split(whole, [self.chunk[pid] for pid in pids], dim=1)):
                numel = math.prod(self.shapes[pid])
                out[pid] = cols.reshape(-1)[:numel].view(self.shapes[pid]).to(ref[pid].dtype)
        return pytree.tree_unflatten(out, spec)

    def clip_grad_norm(self, shards: Any, max_norm: float, eps: float = 1e-6) -> tuple[Any, torch.Tensor]:
        """`(shards * min(1, max_norm / (norm + eps)), norm)`, `norm` over the whole model's summed grads."""
        leaves, spec = self._tree(shards, "grads")
        present = [g for g in leaves if g is not None]
        device = present[0].device if present else self.step.world.device
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for pid in self.owned:
            if leaves[pid] is not None:
                sq += torch.linalg.vector_norm(leaves[pid], 2).to(torch.float64) ** 2
        if self.step.world.size > 1:
            self.step.transport.all_reduce(sq, tuple(range(self.step.world.size)))
        norm = sq.sqrt().to(present[0].dtype if present else torch.float32)
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        return pytree.tree_unflatten([None if g is None else g * coef.to(g.device) for g in leaves], spec), norm

    # -- checkpoints --------------------------------------------------------------------------------------
    def full_state(self, state: Any) -> Any:
        """The state with every slice tree gathered back into whole leaves (a collective over dp groups)."""
        return self._map_state(state, lambda tree: self.all_gather(tree, self._like(tree)))

    def shard_state(self, state: Any) -> Any:
        """A whole-leaf state (as `full_state` returns or `engine.checkpoint.load` reads) cut for this replica."""
        return self._map_state(state, self.shard)

    # -- helpers --------------------------------------------------------------------------------------------
    def _tree(self, tree: Any, what: str) -> tuple[list[Any], pytree.TreeSpec]:
        leaves, spec = pytree.tree_flatten(tree, is_leaf=_is_none)
        missing = [pid for pid in self.local if pid >= len(leaves) or leaves[pid] is None]
        if missing:
            raise EngineError(f"{what}: leaf {missing[0]} is None on this rank, which holds it; pass the trees "
                              "step.shard(params) and step(...) returned (and this optimizer's own state)")
        return leaves, spec

    def _by_dtype(self, leaves: list[Any]) -> list[list[int]]:
        """Buckets of local leaves for one collective each: one dtype and device, at most BUCKET_BYTES (the
        concatenated grads are a transient copy), and a leaf tied over stages alone, so that every position
        holding it sums it in a buffer of the same layout and gets the same bits."""
        groups: dict[tuple[torch.dtype, torch.device], list[list[int]]] = {}
        out = []
        for pid in self.local:
            x = leaves[pid]
            if pid in self.tied:
                out.append([pid])
                continue
            buckets = groups.setdefault((x.dtype, x.device), [[]])
            size = sum(self.chunk[q] for q in buckets[-1]) * self.dp * x.element_size()
            if buckets[-1] and size + x.numel() * x.element_size() > BUCKET_BYTES:
                buckets.append([])
            buckets[-1].append(pid)
        return out + [b for buckets in groups.values() for b in buckets if b]

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        pad = self.dp * math.ceil(max(flat.numel(), 1) / self.dp) - flat.numel()
        return F.pad(flat, (0, pad)) if pad else flat

    def _slice(self, x: torch.Tensor, pid: int) -> torch.Tensor:
        c = self.chunk[pid]
        return self._padded(x)[self.replica * c:(self.replica + 1) * c]

    def _reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel() // self.dp
        if self.dp == 1:
            return flat.clone()
        transport = self.step.transport
        if hasattr(transport, "reduce_scatter"):
            out = torch.empty(n, dtype=flat.dtype, device=flat.device)
            transport.reduce_scatter(out, flat.contiguous(), self.group)
            return out
        total = flat.clone()  # a transport without it (the in-process hub): the sum, then this slice
        transport.all_reduce(total, self.group)
        return total[self.replica * n:(self.replica + 1) * n].clone()

    def _all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        if self.dp == 1:
            return mine
        transport = self.step.transport
        out = torch.zeros(self.dp * mine.numel(), dtype=mine.dtype, device=mine.device)
        if hasattr(transport, "all_gather_into"):
            transport.all_gather_into(out, mine.contiguous(), self.group)
        else:  # zeros elsewhere, summed: exact
            out[self.replica * mine.numel():(self.replica + 1) * mine.numel()] = mine
            transport.all_reduce(out, self.group)
        return out

    def _like(self, tree: Any) -> Any:
        leaves, spec = pytree.tree_flatten(tree, is_leaf=_is_none)
        return pytree.tree_unflatten([None if x is None else x.new_empty(0) for x in leaves], spec)

    def _map_state(self, state: Any, f: Callable[[Any], Any]) -> Any:
        """Apply `f` to each value of the state dict that has the params' tree (plain values pass)."""
        if state is None:
            return None
        if not isinstance(state, dict):
            raise EngineError(f"optimizer state must be the dict engine.optim returns, got {type(state).__name__}")
        n = self.step.graph.num_params
        return {k: f(v) if _is_param_tree(v, n) else v for k, v in state.items()}


def _is_param_tree(value: Any, num_params: int) -> bool:
    leaves = pytree.tree_flatten(value, is_leaf=_is_none)[0]
    return len(leaves) == num_params and any(isinstance(x, torch.Tensor) for x in leaves)


def _tied(step: Any) -> list[int]:
    """Leaves that several pipeline positions hold (a weight tied over stages on different ranks)."""
    where: dict[int, set[int]] = {}
    for info in step.infos:
        for pid in info.stage.param_ids:
            where.setdefault(pid, set()).add(step.table.rank_of(info.stage.index))
    return [pid for pid, positions in where.items() if len(positions) > 1]


def _owned_here(step: Any, position: int) -> list[int]:
    """Local leaves whose norm this position counts: of the positions holding a leaf (tied over stages),
    the lowest; a leaf no stage reads belongs to position 0."""
    owner: dict[int, int] = {}
    for info in step.infos:
        pos = step.table.rank_of(info.stage.index)
        for pid in info.stage.param_ids:
            owner[pid] = min(owner.get(pid, pos), pos)
    return [pid for pid in step.local_params if owner.get(pid, 0) == position]
