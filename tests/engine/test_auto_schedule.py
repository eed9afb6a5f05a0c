"""schedule="auto" and zero-bubble orders from the plan's costs: the planner's choice, what print(plan) shows, and
that the chosen plan runs to torch.func.grad's numbers."""
from __future__ import annotations

import functools

import attrs

import pytest
import torch
from torch.utils import _pytree as pytree

import schedules
from engine.errors import PlanError
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.auto import CANDIDATES, PRUNE, TIE, pick
from engine.planning.candidates import FROM_COSTS
from engine.planning.plan import Plan
from engine.planning.search import plan
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn
from tests.mpi import models

GPT = GPTConfig(vocab_size=256, seq_len=256, d_model=512, n_layers=8, head_dim=64)


@functools.lru_cache(maxsize=None)
def _auto(world: int = 4, microbatches: int = 8) -> Plan:
    params = init_params(GPT, torch.bfloat16, "meta")
    tokens, targets = example_batch(GPT, 4 * microbatches, "meta")
    return plan(make_loss_fn(GPT), params, tokens, targets, world_size=world, device="h100",
                microbatches=microbatches, schedule="auto")


def test_auto_picks_the_earliest_near_fastest_candidate_and_lists_them() -> None:
    p = _auto()
    names = [name for name, _, _ in p.considered]
    assert sorted(names) == sorted(CANDIDATES)  # every built-in, each once
    times = [t for _, _, t in p.considered]
    assert times == sorted(times) and p.predicted_step_time <= times[0] * (1 + TIE)
    near = [name for name, _, t in p.considered if t <= times[0] * (1 + TIE)]
    assert p.schedule == min(near, key=CANDIDATES.index)  # the earliest of the near-ties
    text = str(p)
    assert 'schedule="auto" considered (predicted step):' in text
    assert all(f"  {name}" in text for name in names)
    assert Plan.from_json(p.to_json()) == p


def test_auto_makes_exact_only_the_candidates_near_the_best_estimate() -> None:
    """Two microbatches on four ranks: the fill-drain schedules idle most of the step, so their estimates are
    PRUNE past the best exact prediction and they are listed with their estimate, not searched; the pick is among
    the others."""
    params = init_params(GPT, torch.bfloat16, "meta")
    tokens, targets = example_batch(GPT, 8, "meta")
    p = plan(make_loss_fn(GPT), params, tokens, targets, world_size=4, device="h100", microbatches=2, schedule="auto")
    pruned = {name: t for name, text, t in p.considered if text.endswith("not made exact")}
    exact = {name: t for name, text, t in p.considered if name not in pruned and t != float("inf")}
    assert {"1f1b", "gpipe"} <= set(pruned) and p.schedule in exact
    assert min(pruned.values()) > (1 + PRUNE) * min(exact.values())  # estimates past the exact best too
    assert p.predicted_step_time == min(exact.values()) or p.predicted_step_time <= min(exact.values()) * (1 + TIE)
    assert "not made exact" in str(p)


@pytest.mark.parametrize("times,chosen", [
    ({"1f1b": 10.0, "zbv": 9.95, "dualpipev": 9.94}, "1f1b"),        # all within 1 %: the simplest
    ({"1f1b": 10.0, "zbv": 9.0, "dualpipev": 8.95}, "zbv"),          # zbv and dualpipev tie: the earlier
    ({"1f1b": 10.0, "zbv": 9.0, "dualpipev": 8.0}, "dualpipev"),     # a clear winner
    ({"gpipe": 10.0, "zbv": float("nan")}, "gpipe"),                 # zbv does not fit
    ({"dualpipev": 8.0, "zbv": float("inf"), "gpipe": 8.07}, "gpipe"),  # CANDIDATES' order, not the dict's
])
def test_auto_takes_the_earliest_candidate_within_the_tie(times: dict[str, float], chosen: str) -> None:
    assert pick(times) == chosen


def test_auto_with_nothing_fitting_says_so() -> None:
    with pytest.raises(PlanError, match="no candidate schedule fits"):
        pick({"1f1b": float("inf"), "zbv": float("nan")})


def test_zero_bubble_orders_are_built_from_the_plan_costs() -> None:
    """A zero-bubble plan carries its stages' times; its table is the order built for them, which the simulator
    times no slower than the fixed (F = B = W) order under the plan's own costs."""
    p = _auto()
    chosen = {name: t for name, _, t in p.considered}
    assert min(chosen[name] for name in FROM_COSTS) <= min(chosen["1f1b"], chosen["gpipe"])
    params = init_params(GPT, torch.bfloat16, "meta")
    tokens, targets = example_batch(GPT, 32, "meta")
    zbv = plan(make_loss_fn(GPT), params, tokens, targets, world_size=4, device="h100", microbatches=8, schedule="zbv")
    assert Plan.from_json(zbv.to_json()) == zbv  # the costs come back as the tuples the plan holds
    options = dict(zbv.schedule_options)
    forward, backward, weight, transfer = options["costs"]
    assert len(forward) == zbv.num_stages and max(forward) == 1.0  # in units of the slowest forward
    unit = max(s.forward_time for s in zbv.stages)
    assert all(abs(f - s.forward_time / unit) < 1e-3 for f, s in zip(forward, zbv.stages))
    costs = schedules.Costs(forward=forward, backward_input=backward, backward_weight=weight,
                            comm_latency=0.0, comm_bandwidth=1.0, activation_bytes=transfer)
    built = schedules.simulate(zbv.table(), costs).makespan
    fixed = schedules.simulate(schedules.zbv(zbv.num_stages, zbv.microbatches), costs).makespan
    assert built <= fixed
    assert "zbv order built for the stages' F, B, W and transfer times" in str(zbv)
    # where the search finds no faster order, the plan keeps the hand-built one and says so (and runs it)
    kept = attrs.evolve(zbv, schedule_options=tuple(sorted({**options, "search": False}.items())))
    assert "zbv order: the fastest hand-built one under the stages' F, B, W and transfer times" in str(kept)
    assert "search=False" not in str(kept).splitlines()[0]
    hand = schedules.simulate(kept.table(), costs).makespan
    assert built <= hand and hand == min(schedules.simulate(t, costs).makespan for t in (
        schedules.zbv(zbv.num_stages, zbv.microbatches), schedules.hand_orders.zbv_order(zbv.num_stages // 2,
                                                                                         zbv.microbatches)))


@pytest.mark.parametrize("schedule", ["auto", "interleaved-zb", "dualpipev", "looped-bfs"])
def test_chosen_plan_runs_to_torch_func_grad(schedule: str) -> None:
    params, batch = models.init_params(dtype=torch.float64, layers=4), models.batch(size=16)
    p = plan(models.loss_fn, params, *batch, world_size=2, microbatches=4, device="cpu", schedule=schedule)
    result = run_steps(build_steps(models.loss_fn, params, batch, p), params, batch)
    loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    assert torch.allclose(result.loss, loss, rtol=1e-12)
    for got, want in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(ref)):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-14)
