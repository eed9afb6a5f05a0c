"""ZeRO-1 and the training recipe: the memory terms, the planner's choice, and (under mpirun) equivalence."""
from __future__ import annotations

import re
import sys

import pytest
import torch

import engine
from engine.planning.memory import MemoryModel
from engine.planning.recipe import Recipe
from tests.mpi import models
from tests.mpi.jobs import BIN, launch

PARAMS, BATCH = models.init_params(layers=4, width=32), models.batch(size=16)


def test_recipe_bytes_per_param_match_the_usual_accounting() -> None:
    mixed = Recipe(optimizer="adamw", master_dtype=torch.float32)
    assert mixed.terms(torch.bfloat16, zero=False, dp=8) == {"params": 2, "grads": 2, "master": 4, "optimizer": 8}
    assert mixed.terms(torch.bfloat16, zero=True, dp=8) == {"params": 2, "grads": 2, "master": 0.5, "optimizer": 1}
    assert Recipe(optimizer="sgd").terms(torch.float32, zero=False, dp=1) == {
        "params": 4, "grads": 4, "master": 0, "optimizer": 4}
    assert Recipe(optimizer="none", grad_dtype=torch.float32).terms(torch.bfloat16, zero=True, dp=4) == {
        "params": 2, "grads": 4, "master": 0, "optimizer": 0}
    # no recipe: Adam in the params' dtype, as before
    assert MemoryModel().param_factor == 4.0
    assert MemoryModel(recipe=mixed, param_dtype=torch.bfloat16).param_factor == 8.0  # 16 bytes / 2


@pytest.mark.parametrize("bad, word", [(dict(optimizer="lion"), "optimizer"), (dict(shard_optimizer="yes"), "shard"),
                                       (dict(master_dtype=torch.int32), "master_dtype")])
def test_a_bad_recipe_names_the_fix(bad: dict, word: str) -> None:
    with pytest.raises(engine.PlanError, match=word):
        Recipe(**bad)


def _plan(recipe: Recipe, limit: int | None = None) -> engine.Plan:
    return engine.plan(models.loss_fn, PARAMS, *BATCH, world_size=4, stages=1, dp=4, microbatches=2,
                       recipe=recipe, memory_limit=limit)


def test_the_planner_shards_the_optimizer_only_where_that_makes_the_layout_fit() -> None:
    whole = _plan(Recipe(optimizer="adamw", master_dtype=torch.float32))
    zero = _plan(Recipe(optimizer="adamw", master_dtype=torch.float32, shard_optimizer=True))
    assert not whole.shard_optimizer and zero.shard_optimizer
    terms = {name: v for name, v in zero.memory_terms}
    full = {name: v for name, v in whole.memory_terms}
    assert terms["optimizer"][0] == pytest.approx(full["optimizer"][0] / 4, abs=2)
    assert terms["master"][0] == pytest.approx(full["master"][0] / 4, abs=2)
    assert terms["params"] == full["params"] and sum(sum(v) for _, v in zero.memory_terms) == sum(zero.rank_memory)
    between = (max(whole.rank_memory) + max(zero.rank_memory)) // 2
    auto = Recipe(optimizer="adamw", master_dtype=torch.float32, shard_optimizer="auto")
    assert _plan(auto, between).shard_optimizer
    assert not _plan(auto, max(whole.rank_memory) * 2).shard_optimizer
    with pytest.raises(engine.SplitError):
        _plan(Recipe(optimizer="adamw", master_dtype=torch.float32), between)


def test_print_plan_shows_each_memory_term_per_rank() -> None:
    text = str(_plan(Recipe(optimizer="adamw", master_dtype=torch.float32, shard_optimizer=True)))
    assert "ZeRO-1: optimizer state split over the dp 4 replicas" in text
    assert ("memory per rank (optimizer adamw, master_dtype float32, shard_optimizer True), dp replica 0 "
            "(each alike):") in text
    for term in ("params", "grads", "master", "optimizer", "comm buffers", "activations", "margin", "total"):
        assert re.search(rf"^  {term} +\d", text, flags=re.M), (term, text)
    plan = engine.Plan.from_json(_plan(Recipe(shard_optimizer=True)).to_json())
    assert plan.shard_optimizer and plan.memory_terms[0][0] == "params"


def test_a_sharded_optimizer_needs_a_sharded_plan_and_plain_clipping_refuses_partial_grads() -> None:
    class Fake:
        plan = _plan(Recipe())
    with pytest.raises(engine.EngineError, match="shard_optimizer=True"):
        engine.optim.ShardedOptimizer(Fake(), engine.optim.adamw, lr=1e-3)

    class Sharded:
        plan = _plan(Recipe(shard_optimizer=True))
    with pytest.raises(engine.EngineError, match="ShardedOptimizer"):
        engine.optim.clip_grad_norm({"w": torch.ones(2)}, 1.0, step=Sharded())


def test_one_process_runs_the_sharded_optimizer_as_plain_adamw() -> None:
    step = engine.parallelize(models.loss_fn, PARAMS, *BATCH, microbatches=2, shard_optimizer=True)
    params = step.shard(PARAMS)
    opt = engine.optim.ShardedOptimizer(step, engine.optim.adamw, lr=0.01, max_norm=0.1)
    _, grads = step(params, *BATCH)
    new, state = opt(params, grads, None)
    clipped, _ = engine.optim.clip_grad_norm(grads, 0.1)
    ref, ref_state = engine.optim.adamw(params, clipped, None, lr=0.01)
    for a, b in zip(torch.utils._pytree.tree_leaves((new, opt.full_state(state))),
                    torch.utils._pytree.tree_leaves((ref, ref_state))):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.mpi
def test_zero1_equals_one_process_and_lowers_memory_under_mpirun() -> None:
    cmd = [str(BIN / "mpirun"), "-n", "4", "--oversubscribe", "--bind-to", "none", sys.executable, "tests/mpi/zero.py"]
    out = launch(cmd, timeout=400)
    assert "FAIL" not in out, out
    ok = re.findall(r"^OK rank (\d) (.*) max rel err", out, flags=re.M)
    assert len(ok) == 4 * 2 * 3, out  # 4 ranks x (sgd, adamw) x (3 steps, resumed on dp 4, on dp 1)
    assert len(re.findall(r"^OK rank \d \w+ tied copies: 1 distinct", out, flags=re.M)) == 8, out
    falls = re.findall(r"^OK rank \d memory kept after a step falls (\d+) -> (\d+)", out, flags=re.M)
    assert len(falls) == 4 and all(int(b) <= 0.55 * int(a) for a, b in falls), out


def test_in_process_ranks_run_zero1_over_the_hub_and_match_one_process() -> None:
    """dp 2 x 2 stages as threads of this process (the hub has sums only: the optimizer reduce-scatters
    and all-gathers through them); two clipped adamw steps equal one process's, float64."""
    import threading

    from engine.execution.inprocess import build_steps
    from torch.utils import _pytree as pytree

    plan = engine.plan(models.loss_fn, PARAMS, *BATCH, world_size=4, stages=2, dp=2, microbatches=2,
                       recipe=Recipe(shard_optimizer=True))
    steps = build_steps(models.loss_fn, PARAMS, BATCH, plan)
    ref, ref_state = PARAMS, None
    for _ in range(2):
        grads = torch.func.grad(models.loss_fn)(ref, *BATCH)
        clipped, _ = engine.optim.clip_grad_norm(grads, 0.1)
        ref, ref_state = engine.optim.adamw(ref, clipped, ref_state, lr=0.01)
    out: list = [None] * 4

    def work(r: int) -> None:
        step = steps[r]
        opt = engine.optim.ShardedOptimizer(step, engine.optim.adamw, lr=0.01, max_norm=0.1)
        params, state = step.shard(PARAMS), None
        for _ in range(2):
            _, grads = step(params, *BATCH)
            params, state = opt(params, grads, state)
        out[r] = params

    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    want = pytree.tree_leaves(ref)
    for r in range(4):
        got = pytree.tree_flatten(out[r], is_leaf=lambda x: x is None)[0]
        errs = [((g - w).norm() / w.norm()).item() for g, w in zip(got, want) if g is not None]
        assert errs and max(errs) < 1e-12, (r, errs)


def test_fixed_cuts_also_get_zero1_where_it_makes_them_fit() -> None:
    def cut_plan(shard: bool | str, limit: int | None = None) -> engine.Plan:
        recipe = Recipe(optimizer="adamw", master_dtype=torch.float32, shard_optimizer=shard)
        return engine.plan(models.loss_fn, PARAMS, *BATCH, world_size=4, dp=2, microbatches=2, recipe=recipe,
                           cuts=[14], memory_limit=limit)
    whole, zero = cut_plan(False), cut_plan(True)
    between = (max(whole.rank_memory) + max(zero.rank_memory)) // 2
    cut = cut_plan("auto", between)
    assert cut.shard_optimizer and max(cut.rank_memory) <= between
    assert not cut_plan("auto").shard_optimizer
