"""A step's inputs: checked alone on each rank (no communication) and compared across ranks by fingerprints."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from tests.engine.ranks import on_threads
from engine.execution.inprocess import build_steps
from engine.execution import inputs
from engine.execution.inputs import fingerprints
from engine.execution.step import Step


def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(torch.tanh(torch.tanh(x @ p["w1"]) @ p["w2"]) @ p["w3"], y)


def model() -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"w1": r(8, 32), "w2": r(32, 32), "w3": r(32, 1)}, r(64, 8), r(64, 1)


PARAMS, X, Y = model()


def steps_for(world: int, dp: int = 1) -> tuple[Step, ...]:
    plan = engine.plan(loss_fn, PARAMS, X, Y, world_size=world, dp=dp, microbatches=2, cuts=[2] if world // dp > 1 else None)
    return build_steps(loss_fn, PARAMS, (X, Y), plan)


def on_ranks(steps: Sequence[Step], work: Callable[[int, Step], Any]) -> list[Any]:
    """`work(rank, step)` on every rank at once (threads over the steps' hub); an error is returned as text."""
    out = on_threads(len(steps), lambda r: work(r, steps[r]), timeout=30)
    return [f"{type(x).__name__}: {x}" if isinstance(x, Exception) else x for x in out]


# -- fingerprints ------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]),
       st.integers(1, 300), st.data())
def test_equal_tensors_print_alike_and_one_changed_or_swapped_element_does_not(dtype: torch.dtype, n: int,
                                                                               data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x = (torch.randn(n, generator=g) * 10).to(dtype)
    same = fingerprints([x, x.clone(), x.reshape(1, n).t().contiguous().reshape(n)])
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], same[2]) and int(same[0, 0]) == 1
    i = data.draw(st.integers(0, n - 1))
    changed = x.clone()
    changed[i] = ~changed[i] if dtype == torch.bool else changed[i] + 1
    assert not torch.equal(fingerprints([changed])[0], same[0])
    j = data.draw(st.integers(0, n - 1))
    swapped = x.clone()
    swapped[[i, j]] = x[[j, i]]
    assert torch.equal(fingerprints([swapped])[0], same[0]) == bool(x[i] == x[j])


def test_small_leaves_printed_together_equal_each_printed_alone() -> None:
    """fingerprints() sums small leaves in one pass (running sums over their words, wrapping): the same rows as
    each leaf alone, whatever its dtype, layout or size, and beside a leaf large enough to go alone."""
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(16, 16, generator=g, dtype=torch.float64), torch.randint(-2**62, 2**62, (999,), generator=g),
              torch.randn(3, generator=g).to(torch.bfloat16), torch.ones(2, dtype=torch.bool), torch.zeros(0),
              torch.randn(5, 3, generator=g).t(), torch.full((3,), -1, dtype=torch.int32), torch.zeros(()),
              torch.randn(inputs._SMALL + 5, generator=g)]
    alone = torch.stack([inputs._fingerprint(x) for x in leaves])
    assert torch.equal(fingerprints(leaves)[:, 1:], alone)
    assert torch.equal(inputs._fingerprint_together(leaves), alone)
    assert len({tuple(r) for r in alone.tolist()}) == len(leaves) - 1  # only the two empty-valued leaves alike


def test_many_middling_leaves_are_printed_in_bounded_runs_and_odd_views_print_as_their_values() -> None:
    """Small leaves are summed in runs of at most _GROUP elements (one run of 200 leaves of 65,535 took 0.9 GiB);
    a one-element view that keeps a stride (a batch of one's `data[:, 0]`) and a conjugate view print as copies."""
    g = torch.Generator().manual_seed(5)
    leaves = [torch.randn(inputs._SMALL - 1, generator=g) for _ in range(3 * inputs._GROUP // inputs._SMALL + 1)]
    assert len(inputs._groups(range(len(leaves)), leaves)) == 4
    assert inputs._groups([0, 1], [torch.zeros(0), torch.zeros(())]) == [[0, 1]]  # empty leaves too
    assert torch.equal(fingerprints(leaves)[:, 1:], torch.stack([inputs._fingerprint(x) for x in leaves]))
    strided, z = torch.arange(4).reshape(1, 4)[:, 0], torch.randn(3, dtype=torch.complex64, generator=g)
    rows = fingerprints([strided, strided.clone(), z.conj(), z.conj().resolve_conj(), -z, (-z).clone()])
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[2], rows[3]) and torch.equal(rows[4], rows[5])


def test_leaves_without_data_print_as_absent() -> None:
    rows = fingerprints([None, torch.zeros(3, device="meta"), torch.zeros(()), torch.zeros(0)])
    assert rows[:2].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]] and rows[2:, 0].tolist() == [1, 1]


# -- across ranks (in-process: the hub stands in for the network) ----------------------------------

def test_replicas_and_pipeline_ranks_that_agree_run() -> None:
    steps = steps_for(4, dp=2)
    losses = on_ranks(steps, lambda r, s: float(s(s.shard(PARAMS), X, Y)[0]))
    assert len(set(losses)) == 1 and isinstance(losses[0], float), losses
    assert steps[0].holders() == {0: (0, 2), 1: (1, 3), 2: (1, 3)}  # w1 on position 0, w2 and w3 on position 1


def test_a_replica_with_other_params_is_named_with_its_holders() -> None:
    steps = steps_for(4, dp=2)

    def work(r: int, s: Step) -> Any:
        local = s.shard(PARAMS)
        if r == 3:
            local["w3"] = local["w3"] * 2
        return s(local, X, Y)

    errors = on_ranks(steps, work)
    assert len(set(errors)) == 1 and errors[0].startswith(
        "InputError: the ranks' inputs differ: param 'w3' (held by ranks [1, 3]) differs between ranks [1] and [3]; "
        "every rank must start from the same params"), errors


def test_every_rank_learns_which_rank_refused_its_batch() -> None:
    steps = steps_for(4, dp=2)
    errors = on_ranks(steps, lambda r, s: s(s.shard(PARAMS), X if r != 2 else X[:, :4], Y))
    assert errors[2] == ("InputError: batch leaf 'x' is f32[64,4], the step was planned for f32[64,8]; pass a batch "
                         "shaped like the example batch given to engine.parallelize")
    assert errors[0] == errors[1] == errors[3] == ("InputError: rank 2 refused its inputs (batch leaf 'x': its own "
                                                   "error says what is wrong and the fix), so no rank runs this step")


def test_a_refused_first_step_is_checked_again_and_later_steps_are_not() -> None:
    steps = steps_for(2)
    first = on_ranks(steps, lambda r, s: s(s.shard(PARAMS), X + r, Y))
    assert all("batch leaf 'x' differs between ranks [0] and [1]" in e for e in first), first
    again = on_ranks(steps, lambda r, s: s(s.shard(PARAMS), X + r, Y))
    assert again == first  # nothing ran, so the next step is still the first to check
    ok = on_ranks(steps, lambda r, s: float(s(s.shard(PARAMS), X, Y)[0]))
    later = on_ranks(steps, lambda r, s: float(s(s.shard(PARAMS), X, Y + r)[0]))  # "first": not compared any more
    assert len(set(ok)) == 1 and len(set(later)) == 1 and later != ok


@pytest.mark.parametrize("mode,gathers", [("never", 0), ("first", 1), ("every", 3)])
def test_check_inputs_sets_how_often_the_ranks_compare(mode: str, gathers: int) -> None:
    steps = tuple(Step(s.planned, s.world, s.transport, program=s.program, check_inputs=mode) for s in steps_for(2))
    counted = [0, 0]
    for r, s in enumerate(steps):
        gather = s.transport.all_gather
        s.transport.all_gather = lambda t, _r=r, _g=gather: (counted.__setitem__(_r, counted[_r] + 1), _g(t))[1]
    on_ranks(steps, lambda r, s: [s(s.shard(PARAMS), X, Y) for _ in range(3)])
    assert counted == [gathers, gathers]


def test_check_inputs_must_be_a_known_mode() -> None:
    with pytest.raises(engine.PlanError, match=r"check_inputs must be one of 'first', 'every', 'never', got 'always'"):
        engine.parallelize(loss_fn, PARAMS, X, Y, microbatches=2, check_inputs="always")


# -- one rank alone ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one() -> engine.Step:
    return engine.parallelize(loss_fn, PARAMS, X, Y, microbatches=4)


@pytest.mark.parametrize("batch,message", [
    ((X[:32], Y[:32]), "batch leaf 'x' is f32[32,8], the step was planned for f32[64,8]; pass batches of 64 rows (4 "
                       "microbatches of 16 rows), or call engine.parallelize again with an example batch of 32 rows"),
    ((X, Y.double()), "batch leaf 'y' is f64[64,1], the step was planned for f32[64,1]; cast it (`.to(torch.float32)`), "
                      "or call engine.parallelize again with an example batch of torch.float64"),
    ((X, Y, Y), "the step was given 3 batch arguments, it was planned for 2 (planned batch leaves: x, y); pass the batch "
                "as the example batch was passed to engine.parallelize"),
    ((X, {"y": Y}), "batch argument 2 is a dict with keys ['y'], the step was planned for a tensor (planned batch "
                    "leaves: x, y); pass the batch as the example batch was passed to engine.parallelize"),
    ((X.to("meta"), Y), "batch leaf 'x' is on meta, the step runs on cpu; pass tensors on the CPU"),
])
def test_a_bad_batch_is_refused_before_anything_runs(one: engine.Step, batch: tuple, message: str) -> None:
    with pytest.raises(engine.InputError) as caught:
        one(one.shard(PARAMS), *batch)
    assert str(caught.value) == message


def test_shard_refuses_a_tree_that_is_not_the_traced_one(one: engine.Step) -> None:
    with pytest.raises(engine.InputError, match=r"^param 'w2' given to step.shard is f32\[32,16\], the traced function "
                                                r"takes f32\[32,32\]; pass the params tree given to engine.parallelize$"):
        one.shard({**PARAMS, "w2": PARAMS["w2"][:, :16]})
    with pytest.raises(engine.InputError, match=r"^step.shard was given 2 leaves, the traced function takes 3 \(missing "
                                                r"'w3'\); pass the params tree given to engine.parallelize$"):
        one.shard({"w1": PARAMS["w1"], "w2": PARAMS["w2"]})
    with pytest.raises(engine.InputError, match=r"^param 'w1' given to step.shard on rank 0 is None, and this rank holds "
                                                r"it; pass the params tree given to engine.parallelize, with tensors for "
                                                r"every leaf$"):
        one.shard({**PARAMS, "w1": None})
