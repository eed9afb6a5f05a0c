"""engine.footprint: a rank's device bytes replayed from its program, against the CPU allocator and the planner."""
from __future__ import annotations

import gc

import pytest
import torch

import engine
from engine.planning.devices import LINKS, get_device
from engine.planning.memory import MemoryModel
from engine.planning.op_costs import CostModel
from engine.planning.stage_costs import exact
from tests.cpu_allocator import allocator_peak

D, H, L, B = 128, 512, 4, 64


def _mlp():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    params = {"layers": [{"w1": torch.randn(D, H) / D**0.5, "w2": torch.randn(H, D) / H**0.5} for _ in range(L)],
              "head": torch.randn(D, 10)}

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        for layer in p["layers"]:
            x = x + torch.nn.functional.gelu(x @ layer["w1"]) @ layer["w2"]
        return torch.nn.functional.cross_entropy(x @ p["head"], y)

    return loss_fn, params, torch.randn(B, D), torch.randint(0, 10, (B,))


@pytest.mark.parametrize("schedule,layout", [
    ("1f1b", {}), ("gpipe", {}), ("zb-h1", {}),
    ("interleaved-1f1b", {"stages": 2, "stages_per_rank": 2}), ("zbv", {"stages": 2})])
def test_the_replayed_peak_is_what_the_allocator_holds(schedule: str, layout: dict) -> None:
    """One process runs every stage (B and W fused or apart, stages handing over on the rank): the CPU
    allocator's peak over a step, beyond the params and batch, is the replay's to within 1 %."""
    fn, params, x, y = _mlp()
    step = engine.parallelize(fn, params, x, y, schedule=schedule, microbatches=4, **layout)
    local = step.shard(params)
    step(local, x, y)  # compile and warm up outside the window
    step.executor.grads = {}  # last step's grads die here, not inside the window
    gc.collect()
    measured = allocator_peak(lambda: step(local, x, y))
    (fp,) = step.memory()
    assert fp.peak - fp.static == pytest.approx(measured, rel=0.01), (fp, measured)
    assert fp.static == sum(t.numel() * 4 for t in torch.utils._pytree.tree_leaves(params)) + 4 * (x.nbytes + y.nbytes) // 4


def test_each_rank_of_a_pipeline_agrees_with_the_planner_memory_model() -> None:
    """The planner's model (per stage: weights, grads, saved activations x microbatches in flight,
    temporaries) is what the split is searched with; without Adam state and margin it must match the
    replayed programs of the plan it chose, rank by rank, to within 10 %."""
    fn, params, x, y = _mlp()
    for schedule in ("1f1b", "gpipe", "zb-h1", "zbv"):
        plan = engine.plan(fn, params, x, y, world_size=2, schedule=schedule, microbatches=4,
                           memory_model=MemoryModel(optimizer_factor=0.0, margin=0.0))
        from engine.execution.inprocess import build_steps

        steps = build_steps(fn, params, (x, y), plan)
        replayed = [f.peak for f in steps[0].memory()]
        assert len(replayed) == 2
        for r, (model, replay) in enumerate(zip(plan.rank_memory, replayed)):
            assert model == pytest.approx(replay, rel=0.10), (schedule, r, plan.rank_memory, replayed)


def test_a_footprint_prints_its_peak() -> None:
    fp = engine.Footprint(rank=1, static=2**30, peak=3 * 2**29, peak_at=7, held=(2**30,) * 8)
    assert str(fp) == "rank 1: peak 1.5 GiB at instruction 7 (params and batch 1.0 GiB)"


def test_what_the_transport_holds_all_step_is_static_in_every_ranks_footprint() -> None:
    """Copy-engine rings (engine/execution/copies.py) are allocated when the transport opens them and held until it
    closes: each rank's replay counts its transport's `resident_bytes` with its params and batch, and in its peak."""
    from engine.execution.footprint import footprint
    from engine.execution.inprocess import build_steps

    fn, params, x, y = _mlp()
    plan = engine.plan(fn, params, x, y, world_size=2, schedule="1f1b", microbatches=4)
    steps = build_steps(fn, params, (x, y), plan)
    bare = steps[0].memory()
    for p, fp in zip(steps[0].programs.all(), bare):
        ringed = footprint(p, steps[0].infos, steps[0].graph, microbatches=4, resident=3 << 20)
        assert (ringed.static - fp.static, ringed.peak - fp.peak) == (3 << 20, 3 << 20)
        assert [h - g for h, g in zip(ringed.held, fp.held)] == [3 << 20] * len(fp.held)
    assert steps[0].transport.resident_bytes(0) == 0  # threads of one process: no rings
    steps[0].transport.resident_bytes = lambda rank: 5 << 20 if rank == 1 else 0  # as a transport with rings says
    assert [f.peak - g.peak for f, g in zip(steps[0].memory(), bare)] == [0, 5 << 20]


def test_residuals_on_one_storage_are_held_once() -> None:
    """Two Linears reading one 3-D input (Llama's wq / wk / wv, w1 / w3) each save their own `view(x, [b*t, d])`
    for their weight grad: one storage, held once by the runtime, and so by the replay (it held each view's
    bytes: 0.90-0.95 of the prediction on H100, Llama fx, session 28)."""
    torch.manual_seed(0)
    params = {"layers": [{"a": torch.randn(H, D) / D**0.5, "b": torch.randn(H, D) / D**0.5,
                          "o": torch.randn(D, H) / H**0.5} for _ in range(L)], "head": torch.randn(10, D)}

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        for layer in p["layers"]:
            h = torch.nn.functional.layer_norm(x, (D,))
            x = x + torch.nn.functional.linear(torch.nn.functional.linear(h, layer["a"]).relu()
                                               * torch.nn.functional.linear(h, layer["b"]), layer["o"])
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, p["head"]).flatten(0, 1), y.flatten())

    x, y = torch.randn(B, 8, D), torch.randint(0, 10, (B, 8))
    step = engine.parallelize(loss_fn, params, x, y, schedule="1f1b", microbatches=4, recompute=False)
    local = step.shard(params)
    step(local, x, y)
    step.executor.grads = {}
    gc.collect()
    measured = allocator_peak(lambda: step(local, x, y))
    (fp,) = step.memory()
    assert fp.peak - fp.static == pytest.approx(measured, rel=0.01), (fp, measured)
    # the planner counts the saved views as the replay holds them: one storage each, below the views' sum
    (info,) = step.infos
    (cost,) = exact(step.graph, [], CostModel(get_device("cpu"), LINKS["loopback"]))
    views = set(info.ad.forward.out_slots) - set(info.ad.out_slots)
    assert cost.saved_bytes == info.ad.saved_bytes() < sum(info.ad.slot_avals[s].nbytes for s in views)
