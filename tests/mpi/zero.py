"""Run under mpirun: ZeRO-1 (engine.optim.ShardedOptimizer) equals one process, float64.

    mpirun -n 4 python tests/mpi/zero.py     # 2 stages x dp 2; checkpoints resumed on 1 stage x dp 4, 4 x dp 1
    mpirun -n 2 python tests/mpi/zero.py     # 1 stage x dp 2; resumed on 2 stages x dp 1, 1 x dp 2 (2 GPUs: NCCL)

Per optimizer (sgd with momentum, adamw) with clip_grad_norm: three steps of the sharded run against
three of one process (torch.func.grad, torch.nn.utils.clip_grad_norm_, engine.optim on the whole tree);
then a checkpoint written after two sharded steps is loaded on other dp degrees and the third step taken
there. Every param leaf is compared after every step. Also prints the optimizer state bytes per rank.
Prints one line per check and rank; exits non-zero on a mismatch.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import torch
from torch.utils import _pytree as pytree

import engine
from engine import optim
from tests.cpu_allocator import allocator_peak
from tests.mpi import models

MAX_NORM = 0.05
TOL = 1e-10
OPTIMIZERS = {
    "sgd": (optim.sgd, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adamw": (optim.adamw, dict(lr=0.01, weight_decay=0.1)),
}


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [models.batch(size=16, seed=10 + k) for k in range(n)]


def reference(name: str, steps: int) -> list[list[torch.Tensor]]:
    """Params after each step on one process."""
    update, hyper = OPTIMIZERS[name]
    params, state, out = models.init_params(layers=4), None, []
    for batch in batches(steps):
        grads = torch.func.grad(models.loss_fn)(params, *batch)
        leaves, spec = pytree.tree_flatten(grads)
        ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in leaves]
        for p, g in zip(ps, leaves):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ps, MAX_NORM)
        params, state = update(params, pytree.tree_unflatten([p.grad for p in ps], spec), state, **hyper)
        out.append([x.clone() for x in pytree.tree_leaves(params)])
    return out


def error(params: object, ref: list[torch.Tensor]) -> float:
    mine = pytree.tree_flatten(params, is_leaf=lambda x: x is None)[0]
    return max(((x.cpu() - r).norm() / r.norm()).item() for x, r in zip(mine, ref) if x is not None)


def state_bytes(state: dict) -> int:
    return sum(x.numel() * x.element_size() for x in pytree.tree_leaves(state) if isinstance(x, torch.Tensor))


def make(stages: int, dp: int, shard: bool = True) -> engine.Step:
    return engine.parallelize(models.loss_fn, models.init_params(layers=4), *models.batch(size=16), stages=stages,
                              dp=dp, microbatches=2, shard_optimizer=shard)


def train(step: engine.Step, name: str, params: object, state: object, batch_list: list) -> tuple:
    update, hyper = OPTIMIZERS[name]
    opt = optim.ShardedOptimizer(step, update, max_norm=MAX_NORM, **hyper)
    history = []
    for batch in batch_list:
        _, grads = step(params, *batch)
        params, state = opt(params, grads, state)
        history.append(params)
    return params, state, history, opt


LAYOUTS = {4: ((2, 2), ((1, 4), (4, 1))), 2: ((1, 2), ((2, 1), (1, 2)))}  # world -> trained on, resumed on


def check(rank: int, world: int, name: str, root: str) -> bool:
    (stages, dp), resumes = LAYOUTS[world]
    ref, ok = reference(name, 3), True
    step = make(stages, dp)
    params, state, history, opt = train(step, name, step.shard(models.init_params(layers=4)), None, batches(3))
    errs = [error(p, r) for p, r in zip(history, ref)]
    ok &= report(rank, f"{name} {stages} stages x dp {dp} steps 1-3", max(errs))
    ok &= tied_copies_agree(step, params, rank, name)
    plain = make(stages, dp, shard=False)
    _, grads = plain(plain.shard(models.init_params(layers=4)), *batches(1)[0])
    _, full = OPTIMIZERS[name][0](plain.shard(models.init_params(layers=4)), grads, None, **OPTIMIZERS[name][1])
    print(f"BYTES rank {rank} {name} optimizer state sharded {state_bytes(state)} whole {state_bytes(full)}",
          flush=True)
    ok &= state_bytes(state) < 0.6 * state_bytes(full)
    plain.close()
    # a checkpoint after two steps, resumed on other dp degrees for the third
    step2 = make(stages, dp)
    p2, s2, _, opt2 = train(step2, name, step2.shard(models.init_params(layers=4)), None, batches(2))
    path = os.path.join(root, name)
    engine.checkpoint.save(path, step2, p2, opt2.full_state(s2))
    for stages, dp in resumes:
        other = make(stages, dp)
        loaded, full_state = engine.checkpoint.load(path, other, models.init_params(layers=4))
        opt3 = optim.ShardedOptimizer(other, OPTIMIZERS[name][0], max_norm=MAX_NORM, **OPTIMIZERS[name][1])
        _, grads = other(loaded, *batches(3)[2])
        p3, _ = opt3(loaded, grads, opt3.shard_state(full_state))
        ok &= report(rank, f"{name} resumed on {stages} stages x dp {dp} step 3", error(p3, ref[2]))
        other.close()
    for s in (step, step2):
        s.close()
    return ok


def storage_bytes(tree: object) -> int:
    """Bytes of the distinct storages a tree's tensors keep alive (a view shares its base's)."""
    seen = {}
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


def _peak(fn) -> int:  # type: ignore[no-untyped-def]
    """Bytes allocated at the peak of `fn()` beyond those held before: the CUDA allocator's, else the CPU's."""
    if not torch.cuda.is_available():
        return allocator_peak(fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def memory(rank: int, world: int) -> bool:
    """One adamw step on this rank, whole optimizer state against ZeRO-1 over dp = world: the bytes
    kept afterwards (new params + state: the storages they hold) and the CPU allocator's peak during it.
    (The allocator's own running total is not used for what is kept: gloo's threads free the buffers
    they were handed, and the profiler does not see frees on other threads.)"""
    params, batch = models.init_params(width=96, layers=4), models.batch(size=world * 2)
    held = {}
    for shard in (False, True):
        step = engine.parallelize(models.loss_fn, params, *batch, stages=1, dp=world, microbatches=2,
                                  shard_optimizer=shard)
        local = step.shard(params)
        _, grads = step(local, *batch)
        if shard:
            opt = optim.ShardedOptimizer(step, optim.adamw, lr=0.01)
            update = lambda: opt(local, grads, None)  # noqa: E731
        else:
            update = lambda: optim.adamw(local, grads, None, lr=0.01)  # noqa: E731
        update()  # warm: the first call's one-time allocations stay out of the figure
        kept: list = []
        peak = _peak(lambda: kept.append(update()))
        held[shard] = storage_bytes(kept)
        print(f"MEM rank {rank} {'zero1' if shard else 'whole'} dp {world} adamw step: kept {held[shard]} "
              f"(new params + optimizer state), allocator peak {peak}", flush=True)
        step.close()
    ok = held[True] <= (1 + 2 / world) / 3 * 1.02 * held[False]  # params whole, Adam's 2 moments / dp (+ padding)
    print(f"{'OK' if ok else 'FAIL'} rank {rank} memory kept after a step falls {held[False]} -> {held[True]} "
          f"({held[True] / held[False]:.2f}x)", flush=True)
    return ok


def tied_copies_agree(step: engine.Step, params: dict, rank: int, name: str) -> bool:
    """The tied embedding lives on the first and last stage: after sharded steps its copies are bit-equal."""
    emb = params["embed"]
    digest = None if emb is None else hashlib.sha256(bytes(emb.cpu().contiguous().view(torch.uint8).flatten().tolist())).hexdigest()
    seen = {d for d in step.transport.all_gather_json(digest) if d is not None}
    print(f"{'OK' if len(seen) == 1 else 'FAIL'} rank {rank} {name} tied copies: {len(seen)} distinct", flush=True)
    return len(seen) == 1


def report(rank: int, what: str, err: float) -> bool:
    ok = err <= TOL
    print(f"{'OK' if ok else 'FAIL'} rank {rank} {what} max rel err {err:.1e}", flush=True)
    return ok


def main() -> int:
    world = engine.init()
    root = engine.execution.transport.broadcast_json(tempfile.mkdtemp() if world.rank == 0 else None)
    if world.size not in LAYOUTS:
        raise SystemExit(f"run me on {' or '.join(map(str, LAYOUTS))} ranks, not {world.size}")
    results = [check(world.rank, world.size, name, root) for name in OPTIMIZERS] + [memory(world.rank, world.size)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
