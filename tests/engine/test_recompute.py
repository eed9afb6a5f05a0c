"""Activation recomputation: exact grads, saved bytes that fall, and the planner turning it on when memory is short."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils import _pytree as pytree

import ir
import schedules
from engine.planning.op_costs import CostModel
from engine.planning.devices import get_device, get_link
from engine.errors import PlanError, SplitError
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.memory import MemoryModel, stage_peaks
from engine.planning.plan import Plan, StagePlan
from engine.planning.search import plan
from engine.planning.stage_costs import exact, schedule_costs
from engine.planning.artifacts import level_at, stage_programs
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, head_dim=8)
# meta tensors only: big enough that activations, not weights, fill memory (seq 512, microbatch 4)
MEDIUM = GPTConfig(vocab_size=256, seq_len=512, d_model=512, n_layers=8, head_dim=64)
PLAN_KW = dict(world_size=4, microbatches=8, device="h100", schedule="1f1b")  # 1F1B's memory by rank


def _hand_plan(graph: ir.Graph, schedule: str, recompute: tuple[bool | str, ...], m: int = 4) -> Plan:
    n = len(recompute)
    cuts = tuple(len(graph.eqns) * k // n for k in range(1, n))
    return Plan(schedule, n, n, 1, m, cuts, stages=tuple(StagePlan(k, 0, 0, k) for k in range(n)),
                recompute=[r is True for r in recompute], remat=[r == "cheap" for r in recompute])


@pytest.mark.parametrize("schedule,recompute", [("1f1b", (True, True, True)), ("zb-h1", (True, False, True)),
                                                ("1f1b", (False, "cheap", False)), ("zb-h1", ("cheap", True, False))])
def test_recompute_grads_equal_torch_func_grad(schedule: str, recompute: tuple[bool | str, ...]) -> None:
    """Every level (False: save all; "cheap": redo norms and pointwise chains; True: redo the forward),
    mixed per stage, gives torch.func.grad's loss and grads."""
    params, batch = init_params(TINY, torch.float64), example_batch(TINY, 8)
    fn = make_loss_fn(TINY)
    graph = ir.trace(fn, params, *[b[:2] for b in batch])
    p = _hand_plan(graph, schedule, recompute)
    steps = build_steps(fn, params, batch, p)
    assert [i.ad.saved_bytes() == 0 for i in steps[0].infos] == [r is True for r in recompute]
    plain = stage_programs(graph, p.cuts, device="cpu")
    for info, base, level in zip(steps[0].infos, plain, recompute):  # the cheap level keeps less than none
        assert (info.ad.saved_bytes() < base.ad.saved_bytes()) == (level is not False)
    result = run_steps(steps, params, batch)
    loss, ref = torch.func.grad_and_value(fn)(params, *batch)[::-1]
    assert torch.allclose(result.loss, loss, rtol=1e-12, atol=0)
    for got, want in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(ref)):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-14), (got - want).abs().max()


def test_saved_bytes_fall_and_backward_redoes_the_forward() -> None:
    params, batch = init_params(TINY, torch.float32), example_batch(TINY, 2)
    graph = ir.trace(make_loss_fn(TINY), params, *batch)
    plain = stage_programs(graph, _hand_plan(graph, "1f1b", (False,) * 3).cuts, (False,) * 3, device="cpu")
    redo = stage_programs(graph, _hand_plan(graph, "1f1b", (True,) * 3).cuts, (True,) * 3, device="cpu")
    for a, b in zip(plain, redo):
        assert a.ad.saved_bytes() > 0 and b.ad.saved_bytes() == 0
        # F keeps only what it sends on; B now runs F's matmuls again
        assert set(b.ad.forward.out_slots) == set(b.ad.out_slots)
        mms = [sum(e.op in ("aten.mm.default", "aten.addmm.default", "aten.linear.default") for e in part.graph.eqns)
               for part in (a.ad.backward_input, b.ad.backward_input)]
        assert mms[1] > mms[0], mms
    model = CostModel(get_device("h100"), get_link(None, get_device("h100")))
    cuts = _hand_plan(graph, "1f1b", (False,) * 3).cuts
    for a, b, info in zip(exact(graph, cuts, model), exact(graph, cuts, model, recompute=(True,) * 3), redo):
        outputs = sum(v.aval.nbytes for v in info.stage.graph.outputs if isinstance(v, ir.Var))
        assert b.recompute and info.ad.saved_bytes() == 0 and b.saved_bytes <= outputs < a.saved_bytes
        # B holds one microbatch's recomputed activations while it and W run: a workspace, not per microbatch
        assert b.workspace_bytes > a.workspace_bytes
        assert b.backward_input + b.backward_weight > a.backward_input + a.backward_weight
        assert b.forward == a.forward


def test_plan_recompute_defaults_round_trips_and_checks_length() -> None:
    stages = tuple(StagePlan(k, 0, 0, k) for k in range(2))
    p = Plan("1f1b", 2, 2, 1, 4, (10,), stages)
    assert p.recompute == (False, False) and "recomputation" not in str(p)
    q = Plan("1f1b", 2, 2, 1, 4, (10,), stages, recompute=[1, 0])
    assert q.recompute == (True, False) and Plan.from_json(q.to_json()) == q
    assert str(q).splitlines()[-1] == "activation recomputation on stages [0]"
    with pytest.raises(PlanError, match="3 flags for 2 stages"):
        Plan("1f1b", 2, 2, 1, 4, (10,), stages, recompute=(True, False, True))


@functools.lru_cache(maxsize=None)
def _medium() -> tuple:
    params = init_params(MEDIUM, torch.bfloat16, "meta")
    return make_loss_fn(MEDIUM), params, example_batch(MEDIUM, 32, "meta")


@functools.lru_cache(maxsize=None)
def _roomy() -> Plan:
    fn, params, batch = _medium()
    return plan(fn, params, *batch, recompute=False, **PLAN_KW)


def _exact_stages(p: Plan, recompute: tuple[bool, ...]) -> tuple[CostModel, tuple]:
    fn, params, (tokens, targets) = _medium()
    size = p.microbatch_size
    graph = ir.trace(fn, params, tokens[:size], targets[:size], device="cpu")
    profile = get_device("h100")
    model = CostModel(profile, get_link(None, profile))
    return model, exact(graph, p.cuts, model, recompute=recompute)


def _simulated_peaks(p: Plan) -> tuple[float, ...]:
    """The schedule simulator's memory peaks of `p` from its stages' exact costs (margin left out)."""
    model, stages = _exact_stages(p, tuple(level_at(p.recompute, k, p.remat) for k in range(p.num_stages)))
    return schedules.simulate(p.table(), schedule_costs(stages, p.table(), model, MemoryModel())).peak_memory


def test_memory_limit_turns_recompute_on_for_the_first_stages() -> None:
    fn, params, batch = _medium()
    roomy = _roomy()
    assert roomy.recompute == (False,) * 4
    limit = int(0.7 * roomy.rank_memory[0])  # 1F1B stage 0 holds 4 microbatches: too many at this limit
    with pytest.raises(SplitError, match="activation recomputation makes it fit: pass recompute='auto'"):
        plan(fn, params, *batch, memory_limit=limit, recompute=False, **PLAN_KW)
    tight = plan(fn, params, *batch, memory_limit=limit, **PLAN_KW)  # recompute="auto" is the default
    assert tight.recompute[0] and not tight.recompute[-1], tight.recompute
    assert max(tight.rank_memory) <= limit and all(s.peak_memory <= limit for s in tight.stages)
    assert max(_simulated_peaks(tight)) <= limit
    assert Plan.from_json(tight.to_json()).recompute == tight.recompute
    # the recomputing stage pays its forward again in the backward, and keeps far less per microbatch
    _, plain = _exact_stages(tight, (False,) * 4)
    first = tight.stages[0]
    assert first.backward_input_time + first.backward_weight_time > plain[0].backward_input + plain[0].backward_weight
    without = stage_peaks(tight.table(), [s.memory(MemoryModel()) for s in plain], MemoryModel())
    assert without[0] > limit >= first.peak_memory  # at these very cuts, stage 0 fits only by recomputing


def test_recompute_true_everywhere_and_auto_untouched_with_room() -> None:
    fn, params, batch = _medium()
    everywhere = plan(fn, params, *batch, recompute=True, **PLAN_KW)
    assert everywhere.recompute == (True,) * 4
    assert plan(fn, params, *batch, recompute="auto", **PLAN_KW) == _roomy()
    assert everywhere.predicted_step_time > _roomy().predicted_step_time
    assert max(everywhere.rank_memory) < max(_roomy().rank_memory)
    with pytest.raises(PlanError, match="recompute must be False"):
        plan(fn, params, *batch, recompute="sometimes", **PLAN_KW)


def test_error_says_recompute_was_tried_when_it_does_not_help() -> None:
    fn, params, batch = _medium()
    limit = int(0.3 * _roomy().rank_memory[0])
    with pytest.raises(SplitError) as auto:
        plan(fn, params, *batch, memory_limit=limit, **PLAN_KW)
    assert "even with activation recomputation" in str(auto.value) and "recompute='auto'" not in str(auto.value)
    with pytest.raises(SplitError) as off:
        plan(fn, params, *batch, memory_limit=limit, recompute=False, **PLAN_KW)
    assert "activation recomputation would not make it fit either" in str(off.value)


def test_fixed_cuts_recompute_the_ranks_over_the_limit() -> None:
    fn, params, batch = _medium()
    roomy = _roomy()
    limit = int(0.7 * roomy.rank_memory[0])
    p = plan(fn, params, *batch, cuts=roomy.cuts, memory_limit=limit, **PLAN_KW)
    assert p.cuts == roomy.cuts and p.recompute[0] and max(p.rank_memory) <= limit
    fit = [r for r, m in enumerate(roomy.rank_memory) if m <= limit]
    assert fit == [k for k in range(4) if not p.recompute[k] and not p.remat[k]]  # the others save less


def test_with_memory_to_spare_no_stage_recomputes_anything() -> None:
    """The roomy plan saves what its backward reads: its stage programs redo no forward op but views, so
    a step runs eager autograd's kernels and no more."""
    roomy = _roomy()
    assert roomy.remat == (False,) * 4 and "recomputation" not in str(roomy)
    fn, params, (tokens, targets) = _medium()
    size = roomy.microbatch_size
    graph = ir.trace(fn, params, tokens[:size], targets[:size], device="cpu")
    for info in stage_programs(graph, roomy.cuts, device="cpu"):
        forward = set(info.ad.forward.graph.eqns)
        redone = [e.op for e in info.ad.backward.graph.eqns if e in forward]
        assert all(op.split(".")[1] in ("view", "transpose", "t", "permute", "expand", "unsqueeze", "slice",
                                        "select", "alias", "squeeze", "_unsafe_view", "split", "unbind")
                   for op in redone), redone


def test_cheap_recomputation_first_where_it_is_enough() -> None:
    """A limit between rank 0's peak with the cheap level and without any: the planner turns the cheap
    level on there (not full recomputation, which would pay the whole forward again), costs it exactly,
    and says so in print(plan)."""
    fn, params, batch = _medium()
    roomy = _roomy()
    _, plain = _exact_stages(roomy, (False,) * 4)
    _, cheap = _exact_stages(roomy, ("cheap",) + (False,) * 3)
    mem = MemoryModel()
    peaks = [stage_peaks(roomy.table(), [s.memory(mem, split_bw=False) for s in st], mem)[0] for st in (plain, cheap)]
    assert cheap[0].saved_bytes < plain[0].saved_bytes and peaks[1] < peaks[0]
    assert cheap[0].backward_input + cheap[0].backward_weight > plain[0].backward_input + plain[0].backward_weight
    limit = int(max((peaks[0] + peaks[1]) / 2, *roomy.rank_memory[1:]))  # the other ranks fit as they are
    assert peaks[1] < limit < roomy.rank_memory[0]
    p = plan(fn, params, *batch, cuts=roomy.cuts, memory_limit=limit, **PLAN_KW)
    assert p.remat[0] and not any(p.recompute) and not any(p.remat[1:]), (p.recompute, p.remat)
    assert max(p.rank_memory) <= limit
    assert p.stages[0].time > roomy.stages[0].time
    assert "cheap recomputation (norms, pointwise) on stages [0]" in str(p)


def test_a_fusing_compiler_takes_the_cheap_level_everywhere() -> None:
    """With fused_recompute (inductor folds norms and pointwise chains into the backward's kernels) every
    stage keeps less at no extra kernel: the cheap level on all stages, none recomputing its forward, each
    rank's peak below the plain plan's."""
    fn, params, batch = _medium()
    roomy = _roomy()
    fused = plan(fn, params, *batch, fused_recompute=True, **PLAN_KW)
    assert fused.remat == (True,) * 4 and not any(fused.recompute)
    assert all(a < b for a, b in zip(fused.rank_memory, roomy.rank_memory)), (fused.rank_memory, roomy.rank_memory)
    assert "cheap recomputation (norms, pointwise) on stages [0, 1, 2, 3]" in str(fused)
    assert plan(fn, params, *batch, fused_recompute=True, recompute=False, **PLAN_KW).remat == (False,) * 4


@contextlib.contextmanager
def _trading(on: bool, seen: list | None = None):
    """The cheap level with the trade on or off; `seen` collects each stage's (rb, rw)."""
    from ir import autodiff

    saved = autodiff.RECOMPUTE["cheap"]

    def cheap(g, f, b, w):  # type: ignore[no-untyped-def]
        rb, rw = autodiff._rematerialize(g, f, b, w, trade=on)
        if seen is not None:
            seen.append((rb, rw))
        return rb, rw

    autodiff.RECOMPUTE["cheap"] = cheap
    try:
        yield
    finally:
        autodiff.RECOMPUTE["cheap"] = saved


def _wide_norm_loss(params, x, y):
    """A net whose norms run in float64 on float32 activations (a Llama's float32 RMSNorm on bfloat16, in small)."""
    h = x
    for w, g in zip(params["w"], params["g"]):
        wide = h.double()
        normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).float() * g
        h = h + torch.tanh(normed @ w)
    return ((h - y) ** 2).mean()


def test_trading_saved_values_for_narrower_ones_keeps_torch_func_grads() -> None:
    """"cheap" may save a narrower operand and redo what it made (`_traded`): the grads stay torch.func.grad's."""
    torch.manual_seed(0)
    params = {"w": [torch.randn(16, 16) / 4 for _ in range(3)], "g": [torch.rand(16) + 0.5 for _ in range(3)]}
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    graph = ir.trace(_wide_norm_loss, params, x[:2], y[:2])
    p = _hand_plan(graph, "1f1b", ("cheap",), m=4)
    steps = build_steps(_wide_norm_loss, params, (x, y), p)
    with _trading(False):
        (untraded,) = stage_programs(graph, (), ("cheap",), device="cpu")
    assert steps[0].infos[0].ad.saved_bytes() < untraded.ad.saved_bytes()  # a trade was made (432 < 544 bytes)
    result = run_steps(steps, params, (x, y))
    loss, ref = torch.func.grad_and_value(_wide_norm_loss)(params, x, y)[::-1]
    assert torch.allclose(result.loss, loss, rtol=1e-6, atol=0)
    for got, want in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(ref)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (got - want).abs().max()


def test_the_cheap_level_saves_a_norms_bfloat16_input_rather_than_its_float32_copy() -> None:
    """The Llama's RMSNorm computes in float32 on bfloat16 activations: "cheap" redoes `x.float()` in the backward
    from the bfloat16 `x`, saved in its place (half the bytes), so no float32 activation is saved (2 x H100,
    2026-11-26: 32 MiB a norm a microbatch, 1.1 GiB of rank 0's 6.0 GiB at p = 2)."""
    from benchmarks.families import family

    fam = family("llama", "tiny")
    params = fam.params(torch.bfloat16, "cpu", 0)
    tokens, targets = fam.batch(4, seed=1)
    graph = ir.trace(fam.loss_fn(), params, tokens[:2], targets[:2])
    (cheap,) = stage_programs(graph, (), ("cheap",), device="cpu")
    ad = cheap.ad
    saved = [ad.slot_avals[s] for s in ad.forward.out_slots if s not in ad.out_slots]
    c = fam.config
    wide = [a for a in saved if a.dtype == torch.float32 and tuple(a.shape) == (2, c.seq_len, c.d_model)]
    assert not wide, [str(a) for a in saved]
    assert any(a.dtype == torch.bfloat16 and tuple(a.shape) == (2, c.seq_len, c.d_model) for a in saved)


def _wide_output(params, x):
    wide = (x @ params["w"]).double()
    return wide, (wide * wide).sum()


def _shared(params, x):
    a, b = x @ params["wa"], x @ params["wb"]
    v = a.double() + b.double()
    t = a.double() * 3
    return (v * v).mean() + (v @ params["p"]).mean() + (t * t).mean()


@pytest.mark.parametrize("case", ["stage output", "read by B and W", "llama cuts"])
def test_a_trade_never_adds_saved_bytes_nor_runs_an_equation_in_both_b_and_w(case: str) -> None:
    """Trades are kept only where F's saved bytes fall in total: not for a value the stage returns anyway (its
    wide copy would be saved *and* its narrow operand), and B never redoes an equation W redoes (a value read by
    both, traded in W, then at hand for B). Over every cut of the tiny bfloat16 Llama as well."""
    from benchmarks.families import family

    n = 16
    if case == "stage output":  # every input differentiated, both outputs get cotangents
        graphs = [ir.trace(_wide_output, {"w": torch.randn(n, n)}, torch.randn(n, n))]
    elif case == "read by B and W":
        params = {"wa": torch.randn(n, n), "wb": torch.randn(n, n), "p": torch.randn(n, n, dtype=torch.float64)}
        graphs = [ir.trace(_shared, params, torch.randn(2, n))]
    else:
        fam = family("llama", "tiny")
        tokens, targets = fam.batch(2, seed=1)
        graph = ir.trace(fam.loss_fn(), fam.params(torch.bfloat16, "cpu", 0), tokens, targets)
        cuts = range(10, len(graph.eqns) - 10, len(graph.eqns) // 6)
        graphs = [st.graph for cut in cuts for st in ir.split(graph, (cut,))]
    for graph in graphs:
        seen: list = []
        with _trading(True, seen):
            traded = ir.stage_autodiff(graph, recompute="cheap")
        with _trading(False):
            untraded = ir.stage_autodiff(graph, recompute="cheap")
        assert traded.saved_bytes() <= untraded.saved_bytes(), case
        assert all(not (rb & rw) for rb, rw in seen), case
