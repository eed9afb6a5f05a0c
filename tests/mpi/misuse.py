"""Misuse under mpirun, case after case in one job (tests/engine/test_misuse_mpi.py reads its output).

    mpirun -n 2 python tests/mpi/misuse.py [CASE ...]
Every rank prints `CASE <name> rank <r> <seconds>s <ErrorType>: <message>` per case (`ok: <summary>` when
nothing is raised). A case's error is raised on every rank before the pipeline communicates, so the job
stays healthy for the next case; a barrier after each case shows the ranks are still in step (a job that
is not prints `DESYNC` and exits). Steps are made with timeout=8, so a hang surfaces as CommTimeoutError
within a case's 10 s rather than as a stalled job.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import engine
from tests.mpi import models
from tests.mpi.misuse_kit import CASES, TIMEOUT, Ctx, case, loss_fn, loss_text, mlp, silent

# -- the table ------------------------------------------------------------------------------

@case
def step_ok(c: Ctx) -> str:
    step = c.step("base")
    loss, grads = step(c.local("base"), c.x, c.y)
    held = [n for n in ("w1", "w2", "w3") if grads[n] is not None]
    return f"{loss_text(loss)}, grads of {held}"


@case
def short_batch(c: Ctx) -> str:
    step = c.step("base")
    with silent(step):
        step(c.local("base"), c.x[:32], c.y[:32])
    return "accepted"


@case
def double_batch(c: Ctx) -> str:
    step = c.step("base")
    with silent(step):
        step(c.local("base"), c.x.double(), c.y.double())
    return "accepted"


@case
def vector_loss(c: Ctx) -> str:
    def vector(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((mlp(params, x) - y) ** 2).sum(1)

    engine.parallelize(vector, c.params, c.x, c.y, microbatches=4, timeout=TIMEOUT)
    return "accepted"


@case
def tuple_loss(c: Ctx) -> str:
    def pair(params: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out = mlp(params, x)
        return F.mse_loss(out, y), {"mae": (out - y).abs().mean()}

    engine.parallelize(pair, c.params, c.x, c.y, microbatches=4, timeout=TIMEOUT)
    return "accepted"


@case
def batch_differs(c: Ctx) -> str:
    step = c.step("first")
    loss, _ = step(step.shard(c.params), c.x + c.rank, c.y)
    return loss_text(loss)


@case
def params_differ(c: Ctx) -> str:
    step = c.step("every")
    mine = {k: v + c.rank for k, v in c.params.items()}
    loss, _ = step(step.shard(mine), c.x, c.y)
    return loss_text(loss)


def _readme(seed: bool) -> str:
    """The README's Usage snippet: `seed=False` is the old one (each rank draws its own values)."""
    torch.manual_seed(0) if seed else torch.seed()
    params = {"w1": torch.randn(8, 32) / 8**0.5, "w2": torch.randn(32, 1) / 32**0.5}
    x, y = torch.randn(64, 8), torch.randn(64, 1)

    def readme_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ params["w1"])
        return F.mse_loss(h @ params["w2"], y)

    step = engine.parallelize(readme_loss, params, x, y, schedule="1f1b", microbatches=4, timeout=TIMEOUT)
    local, state = step.shard(params), None
    for _ in range(3):
        loss, grads = step(local, x, y)
        local, state = engine.optim.adamw(local, grads, state, lr=1e-2)
    return loss_text(loss)


@case
def readme_unseeded(c: Ctx) -> str:
    return _readme(seed=False)


@case
def readme_seeded(c: Ctx) -> str:
    return _readme(seed=True)


@case
def memory_limit_tiny(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, microbatches=4, memory_limit=1024, timeout=TIMEOUT)
    return "accepted"


# -- what already worked and must stay ------------------------------------------------------------------

@case
def unknown_schedule(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, schedule="1fb1", microbatches=4, timeout=TIMEOUT)
    return "accepted"


@case
def batch_does_not_split(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, microbatches=5, timeout=TIMEOUT)
    return "accepted"


@case
def ranks_choose_other_options(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, microbatches=4 if c.rank == 0 else 2, cuts=[2], timeout=TIMEOUT)
    return "accepted"


# -- the loss contract, at trace time ----------------------------------------------------------------

def _plan(c: Ctx, fn: Callable, **options: Any) -> str:
    fn.__name__ = "loss_fn"
    engine.parallelize(fn, c.params, c.x, c.y, microbatches=4, timeout=TIMEOUT, **options)
    return "accepted"


@case
def integer_loss(c: Ctx) -> str:
    return _plan(c, lambda p, x, y: (mlp(p, x) > y).sum())


@case
def loss_without_params(c: Ctx) -> str:
    return _plan(c, lambda p, x, y: F.mse_loss(x[:, :1], y))


@case
def loss_through_detach(c: Ctx) -> str:
    return _plan(c, lambda p, x, y: F.mse_loss(mlp(p, x).detach(), y))


@case
def has_aux_without_a_pair(c: Ctx) -> str:
    return _plan(c, lambda p, x, y: F.mse_loss(mlp(p, x), y), has_aux=True)


@case
def has_aux_integer_leaf(c: Ctx) -> str:
    return _plan(c, lambda p, x, y: (F.mse_loss(mlp(p, x), y), {"hits": (mlp(p, x) > 0).sum()}), has_aux=True)


@case
def has_aux_ok(c: Ctx) -> str:
    def with_aux(params: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out = mlp(params, x)
        return F.mse_loss(out, y), {"mae": (out - y).abs().mean(), "positive": (out > 0).float().mean()}

    step = engine.parallelize(with_aux, c.params, c.x, c.y, microbatches=4, has_aux=True, timeout=TIMEOUT)
    (loss, aux), _ = step(step.shard(c.params), c.x, c.y)
    _, (ref, ref_aux) = torch.func.grad_and_value(with_aux, has_aux=True)(c.params, c.x, c.y)
    err = max(abs(float(loss - ref)), *(abs(float(aux[k] - ref_aux[k])) for k in ref_aux))
    return f"{loss_text(loss)}, mae {float(aux['mae']):.6f}, positive {float(aux['positive']):.4f}, " \
           f"{'equal' if err < 1e-5 else 'DIFFERENT'} to torch.func.grad_and_value"


def contrastive(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every row's embedding scored against every other row's (CLIP's loss): not a mean over the batch."""
    a, b = torch.tanh(x @ params["w1"]), torch.tanh(x @ params["w2"][:8])
    return F.cross_entropy(a @ b.t(), torch.arange(len(x)))


@case
def loss_compares_rows(c: Ctx) -> str:
    engine.parallelize(contrastive, c.params, c.x, c.y, microbatches=4, timeout=TIMEOUT)
    return "accepted"


@case
def loss_compares_rows_whole(c: Ctx) -> str:
    step = engine.parallelize(contrastive, c.params, c.x, c.y, microbatches=1, timeout=TIMEOUT)
    loss, _ = step(step.shard(c.params), c.x, c.y)
    err = abs(float(loss - contrastive(c.params, c.x, c.y)))
    return f"{loss_text(loss)}, {'equal' if err < 1e-5 else 'DIFFERENT'} to the function on the whole batch"


# -- one rank's inputs, checked alone (no communication) -----------------------------------------------

def _local(c: Ctx, *batch: Any, params: Any = None) -> str:
    step = c.step("base")
    with silent(step):
        step(c.local("base") if params is None else params, *batch)
    return "accepted"


@case
def missing_batch_argument(c: Ctx) -> str:
    return _local(c, c.x)


@case
def batch_leaf_not_a_tensor(c: Ctx) -> str:
    return _local(c, c.x, 0.5)


@case
def batch_of_other_width(c: Ctx) -> str:
    return _local(c, c.x[:, :7], c.y)


@case
def batch_on_meta(c: Ctx) -> str:
    return _local(c, c.x.to("meta"), c.y)


@case
def params_missing_a_leaf(c: Ctx) -> str:
    local = c.local("base")
    return _local(c, c.x, c.y, params={"w1": local["w1"], "w2": local["w2"]})


@case
def params_on_meta(c: Ctx) -> str:
    local = {k: None if v is None else v.to("meta") for k, v in c.local("base").items()}
    return _local(c, c.x, c.y, params=local)


@case
def params_not_sharded(c: Ctx) -> str:
    return _local(c, c.x, c.y, params=[c.params["w1"], c.params["w2"], c.params["w3"]])


@case
def shard_of_float64_params(c: Ctx) -> str:
    step = c.step("base")
    with silent(step):
        step.shard({k: v.double() for k, v in c.params.items()})
    return "accepted"


@case
def shard_keys_in_another_order(c: Ctx) -> str:
    step = c.step("base")
    with silent(step):
        step.shard({k: c.params[k] for k in ("w3", "w2", "w1")})
    return "accepted"


@case
def check_never_refuses_alone(c: Ctx) -> str:
    step = c.step("never")
    with silent(step):
        step(step.shard(c.params), c.x[:32], c.y[:32])
    return "accepted"


# -- what only one rank got wrong, and ranks that disagree ---------------------------------------------

@case
def one_rank_short_batch(c: Ctx) -> str:
    step = c.step("every")
    n = 32 if c.rank == 1 else 64
    loss, _ = step(step.shard(c.params), c.x[:n], c.y[:n])
    return loss_text(loss)


def _one_rank_param(c: Ctx, rank: int, leaf: str, change: Callable[[torch.Tensor], Any]) -> str:
    """Only `rank` changes its param `leaf` after `step.shard`; every rank must refuse the step."""
    step = c.step("every")
    local = step.shard(c.params)
    if c.rank == rank:
        local[leaf] = change(local[leaf])
    loss, _ = step(local, c.x, c.y)
    return loss_text(loss)


@case
def one_rank_float64_param(c: Ctx) -> str:
    return _one_rank_param(c, 1, "w3", lambda w: w.double())


@case
def one_rank_none_param(c: Ctx) -> str:
    return _one_rank_param(c, 0, "w1", lambda w: None)


@case
def every_catches_a_later_step(c: Ctx) -> str:
    step = c.step("every")
    local = step.shard(c.params)
    first, _ = step(local, c.x, c.y)
    step(local, c.x, c.y + c.rank)
    return f"first step {loss_text(first)}; second accepted"


@case
def first_checks_the_first_step_only(c: Ctx) -> str:
    step = c.step("first")
    local = step.shard(c.params)
    step(local, c.x, c.y)  # the first step of this step was taken in batch_differs, which raised: this one checks
    loss, _ = step(local, c.x, c.y + c.rank)  # a later step is not compared under "first" (documented)
    return f"second step unchecked, {loss_text(loss)}"


@case
def tied_weight_differs(c: Ctx) -> str:
    step = c.step("tied")
    params, batch = models.init_params(layers=4), models.batch(size=16)
    local = step.shard(params)
    local["embed"] = local["embed"] + c.rank  # after shard: the tied copies on ranks 0 and 1 now differ
    loss, _ = step(local, *batch)
    return loss_text(loss)


@case
def dp_replicas_differ(c: Ctx) -> str:
    step = c.step("dp")
    local = step.shard(c.params)
    local["w2"] = local["w2"] * (1 + c.rank)
    loss, _ = step(local, c.x, c.y)
    return loss_text(loss)


@case
def dp_batch_differs(c: Ctx) -> str:
    step = c.step("dp")
    loss, _ = step(step.shard(c.params), c.x, c.y + c.rank)
    return loss_text(loss)


@case
def check_inputs_unknown(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, microbatches=4, check_inputs="sometimes", timeout=TIMEOUT)
    return "accepted"


@case
def ranks_choose_other_checks(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, microbatches=4, cuts=[2], timeout=TIMEOUT,
                       check_inputs="first" if c.rank == 0 else "never")
    return "accepted"


# -- replicas per stage ------------------------------------------------------------------------------

@case
def replicas_bad_count(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, microbatches=4, replicas=(1, 0), timeout=TIMEOUT)
    return "accepted"


@case
def replicas_too_many_ranks(c: Ctx) -> str:
    engine.parallelize(loss_fn, c.params, c.x, c.y, microbatches=4, replicas=(2, 1), timeout=TIMEOUT)
    return "accepted"


# -- the job ----------------------------------------------------------------------------------------

def run(c: Ctx, name: str) -> None:
    start = time.perf_counter()
    try:
        kind, text = "ok", CASES[name](c)
    except Exception as exc:  # noqa: BLE001 -- every error is the case's result
        kind, text = type(exc).__name__, str(exc)
    took = time.perf_counter() - start
    one_line = text.replace("\n", " | ")
    sys.stdout.write(f"CASE {name} rank {c.rank} {took:.2f}s {kind}: {one_line}\n")
    sys.stdout.flush()


def main() -> int:
    world = engine.init(timeout=TIMEOUT)
    c = Ctx(world)
    for name in sys.argv[1:] or list(CASES):
        run(c, name)
        try:
            dist.barrier()
        except Exception as exc:  # noqa: BLE001 -- the ranks are no longer in step: stop the job
            print(f"DESYNC after {name} rank {c.rank}: {exc}", flush=True)
            return 3
    print(f"DONE rank {c.rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
