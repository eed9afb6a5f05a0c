"""Misuse under mpirun at 2 ranks: every rank ends each case with the expected error, within 10 s, none hangs.

One launch of tests/mpi/misuse.py runs every case in turn (each error is raised on every rank before the
pipeline communicates, so the job stays healthy); this file reads its `CASE` lines and holds what each
rank must say. A case in `PER_RANK` gets a different message per rank (one rank got bad input, its peer
is told which rank refused and which leaf); `ok` cases are the controls.
"""
from __future__ import annotations

import re
import sys

import pytest

from tests.mpi.jobs import BIN, launch
from tests.mpi.misuse import CASES

pytestmark = pytest.mark.mpi
CASE_LIMIT_S = 10.0
LINE = re.compile(r"^CASE (\S+) rank (\d+) ([\d.]+)s (\w+): (.*)$", flags=re.M)

BATCH_FIX = ("every rank must pass the same full batch (each rank takes its share): seed its random draws "
             "(torch.manual_seed) or load it alike on every rank")
PARAMS_FIX = ("every rank must start from the same params: seed their initialisation (torch.manual_seed) on every "
              "rank, or make them on rank 0 and broadcast them; the copies several ranks hold must get equal updates")
CONTRACT = "the loss function must return one floating-point scalar tensor (0-dim: a mean over the batch) that " \
           "depends on the params"
SHORT = ("batch leaf 'x' is f32[32,8], the step was planned for f32[64,8]; pass batches of 64 rows (4 microbatches "
         "of 16 rows), or call engine.parallelize again with an example batch of 32 rows")
NO_PARAMS = (f"loss_fn's loss does not depend on any param (it is computed from the batch alone, or through "
             f"detach), so every grad would be zero; {CONTRACT}")
def other_plan(parts: str) -> str:
    return (rf"ranks \[1\] built a different {parts} than rank 0 \(fingerprints \['[0-9a-f]{{12}}', '[0-9a-f]{{12}}'\]\); "
            r"every rank must call parallelize with the same function, shapes, dtypes and options, and run the "
            r"same fnpipe")


def differ(*what: str, more: int = 0) -> str:
    fixes = [fix for fix, word in ((BATCH_FIX, "batch leaf"), (PARAMS_FIX, "param ")) if any(w.startswith(word)
                                                                                          for w in what)]
    tail = f"; and {more} more" if more else ""
    return "the ranks' inputs differ: " + "; ".join(f"{w} differs between ranks [0] and [1]" for w in what) + \
        tail + "; " + "; ".join(fixes)


def refused(rank: int, leaf: str) -> str:
    return f"rank {rank} refused its inputs ({leaf}: its own error says what is wrong and the fix), so no rank runs this step"


# case -> (error type, message): the same on both ranks (a message is exact, a `re:` one a pattern)
SAME: dict[str, tuple[str, str]] = {
    # the table
    "short_batch": ("InputError", SHORT),
    "double_batch": ("InputError", "batch leaf 'x' is f64[64,8], the step was planned for f32[64,8]; cast it "
                     "(`.to(torch.float32)`), or call engine.parallelize again with an example batch of torch.float64"),
    "vector_loss": ("TraceError", f"vector returns a loss of shape f32[16] (traced on a microbatch of 16 rows), not a "
                    f"scalar; {CONTRACT}: reduce it over the batch, e.g. `.mean()`"),
    "tuple_loss": ("TraceError", f"pair returns a tuple of 2 tensors (f32[], f32[]); {CONTRACT}. To return auxiliary "
                   "values too, pass has_aux=True and return (loss, aux), aux a pytree of float tensors; step(...) "
                   "then returns ((loss, aux), grads)"),
    "batch_differs": ("InputError", differ("batch leaf 'x'")),
    "params_differ": ("InputError", differ(*(f"param 'w{k}' given to step.shard" for k in (1, 2, 3)))),
    "readme_unseeded": ("InputError", differ("batch leaf 'x'", "batch leaf 'y'", "param 'w1' given to step.shard",
                                             more=1)),
    "readme_seeded": ("ok", r"re:loss \d+\.\d{6}"),
    "memory_limit_tiny": ("SplitError", "re:schedule=\"auto\": no schedule fits: 1f1b, [a-z0-9-, ]+: "
                          "no layout fits: 2 stages on 2 ranks x dp 1, 4 microbatches: no split into "
                          r"2 stages fits.*: stage 0 needs at least \d+\.\d KiB with 2 microbatches in flight, its limit "
                          r"is 1\.0 KiB; the largest single block \(.*\) needs \d+\.\d KiB alone.*raise memory_limit"),
    # what already worked and must stay
    "unknown_schedule": ("PlanError", "unknown schedule '1fb1'; known: 1f1b, dualpipev, gpipe, interleaved-1f1b, interleaved-zb, looped-bfs, zb-h1, zbv; did "
                         "you mean '1f1b'?"),
    "batch_does_not_split": ("PlanError", "batch size 64 does not split into dp x microbatches equal parts "
                             "(microbatches=5, dp=None, world_size=2); valid microbatch counts: dp 1: [1, 2, 4, 8, 16, "
                             "32, 64]; pass the full batch, with a size that dp x microbatches divides"),
    "ranks_choose_other_options": ("RuntimeMismatchError", "re:" + other_plan(r"plan \([a-z_, ]+\), schedule table and traced graph")),
    # the loss contract
    "integer_loss": ("TraceError", f"loss_fn returns a loss of type i64[]; {CONTRACT}: an integer or bool value has "
                     "no gradient; compute the loss in floating point"),
    "loss_without_params": ("TraceError", NO_PARAMS),
    "loss_through_detach": ("TraceError", NO_PARAMS),
    "has_aux_without_a_pair": ("TraceError", "loss_fn returns a single tensor, but has_aux=True asks for a pair (loss, "
                               "aux): the loss a floating-point scalar tensor, aux a pytree of float tensors; return "
                               "(loss, aux), or drop has_aux"),
    "has_aux_integer_leaf": ("TraceError", "loss_fn returns 'aux.hits' as i64[]; aux leaves are averaged over the "
                             "microbatches like the loss, so they must be floating-point: `.float()` a count (its "
                             "average is then the mean over the batch)"),
    "has_aux_ok": ("ok", r"re:loss \d+\.\d{6}, mae \d+\.\d{6}, positive \d\.\d{4}, equal to torch.func.grad_and_value"),
    # a loss that compares rows (engine/planning/rows.py): refused alike on every rank, exact as one microbatch
    "loss_compares_rows": ("InputError", r"re:the loss compares rows of the batch with each other, so cutting its 64 "
                           r"rows into 1 dp replica x 4 microbatches would give wrong numbers: .* \| `matmul` "
                           r"\(equation \d+: f32\[16,32\], f32\[32,16\] -> f32\[16,16\]\) pairs the batch's rows: "
                           r"its output has them in dims 0 and 1, every row against every other \|   at misuse\.py:"
                           r"\d+ in contrastive: return F\.cross_entropy\(a @ b\.t\(\), torch\.arange\(len\(x\)\)\) "
                           r"\| Fix: run it on the whole batch, parallelize\(\.\.\., microbatches=1, dp=1\) .*"),
    "loss_compares_rows_whole": ("ok", r"re:loss \d+\.\d{6}, equal to the function on the whole batch"),
    # one rank's inputs alone (no communication: `silent` in the script fails the case otherwise)
    "missing_batch_argument": ("InputError", "the step was given 1 batch argument, it was planned for 2 (planned batch "
                               "leaves: x, y); pass the batch as the example batch was passed to engine.parallelize"),
    "batch_leaf_not_a_tensor": ("InputError", "batch leaf 'y' is a float, the step was planned for a tensor f32[64,1]; "
                                "pass tensors"),
    "batch_of_other_width": ("InputError", "batch leaf 'x' is f32[64,7], the step was planned for f32[64,8]; pass a "
                             "batch shaped like the example batch given to engine.parallelize"),
    "batch_on_meta": ("InputError", "batch leaf 'x' is on meta, the step runs on cpu; pass tensors on the CPU"),
    "params_missing_a_leaf": ("InputError", "params has 2 leaves, the traced function 3 (missing 'w3'); pass the tree "
                              "returned by step.shard(params)"),
    "params_not_sharded": ("InputError", "params has 3 leaves, the traced function 3 (missing 'w1', 'w2', 'w3'; "
                           "unexpected '0', '1', '2'); pass the tree returned by step.shard(params)"),
    "shard_of_float64_params": ("InputError", "param 'w1' given to step.shard is f64[8,32], the traced function takes "
                                "f32[8,32]; pass the params tree given to engine.parallelize"),
    "shard_keys_in_another_order": ("InputError", "step.shard was given 3 leaves, the traced function takes 3 (the same "
                                    "leaf names in another order or other containers: build the tree as the one given "
                                    "to engine.parallelize); pass the params tree given to engine.parallelize"),
    "check_never_refuses_alone": ("InputError", SHORT),
    # ranks that disagree, on the steps check_inputs names
    "every_catches_a_later_step": ("InputError", differ("batch leaf 'y'")),
    "first_checks_the_first_step_only": ("ok", r"re:second step unchecked, loss \d+\.\d{6}"),
    "tied_weight_differs": ("InputError", differ("param 'embed' (held by ranks [0, 1])")),
    "dp_replicas_differ": ("InputError", differ("param 'w2' (held by ranks [0, 1])")),
    "dp_batch_differs": ("InputError", differ("batch leaf 'y'")),
    "check_inputs_unknown": ("PlanError", "check_inputs must be one of 'first', 'every', 'never', got 'sometimes': "
                             "'first' compares the ranks' inputs on the first step, 'every' on every step"),
    "ranks_choose_other_checks": ("RuntimeMismatchError", "re:" + other_plan("check_inputs setting")),
    # replicas per stage: refused alike on every rank, before planning
    "replicas_bad_count": ("PlanError", "replicas must be one int >= 1 per pipeline stage, like (2, 1) for stage 0 "
                           "on 2 ranks and stage 1 on 1; got (1, 0)"),
    "replicas_too_many_ranks": ("PlanError", "replicas=(2, 1) use 3 ranks per pipeline replica, which does not divide "
                                "world_size=2; give counts summing to a divisor of 2 ([1, 2])"),
}
ON_META = ("param '{}' on rank {} is on meta, this rank runs on cpu; pass the tree from step.shard(params) (it moves "
           "this rank's leaves there)")
PER_RANK: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "step_ok": (("ok", r"re:loss (\d+\.\d{6}), grads of \['w1', 'w2'\]"), ("ok", r"re:loss (\d+\.\d{6}), grads of \['w3'\]")),
    "params_on_meta": (("InputError", ON_META.format("w1", 0)), ("InputError", ON_META.format("w3", 1))),
    "one_rank_short_batch": (("InputError", refused(1, "batch leaf 'x'")), ("InputError", SHORT)),
    "one_rank_float64_param": (("InputError", refused(1, "param 'w3'")),
                               ("InputError", "param 'w3' on rank 1 should be f32[32,1], got f64[32,1]; pass the tree "
                                              "from step.shard(params)")),
    "one_rank_none_param": (("InputError", "param 'w1' on rank 0 should be f32[8,32], got None; pass the tree from "
                                           "step.shard(params)"), ("InputError", refused(0, "param 'w1'"))),
}


@pytest.fixture(scope="module")
def job() -> str:
    cmd = [str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "tests/mpi/misuse.py"]
    return launch(cmd, timeout=150)


@pytest.fixture(scope="module")
def results(job: str) -> dict[tuple[str, int], tuple[float, str, str]]:
    return {(name, int(rank)): (float(took), kind, text) for name, rank, took, kind, text in LINE.findall(job)}


def test_the_suite_covers_every_case_on_both_ranks_and_no_rank_hangs(job: str, results: dict) -> None:
    assert len(CASES) >= 25 and set(CASES) == set(SAME) | set(PER_RANK), sorted(set(CASES) ^ (set(SAME) | set(PER_RANK)))
    assert set(results) == {(name, r) for name in CASES for r in range(2)}, job
    assert "DESYNC" not in job and \
        sorted(re.findall(r"^DONE rank (\d)", job, flags=re.M)) == ["0", "1"], job
    assert not [k for k, (_, kind, _) in results.items() if kind == "CommTimeoutError"], job


@pytest.mark.parametrize("name", sorted(set(SAME) | set(PER_RANK)))
def test_every_rank_gives_the_expected_error_within_10_s(results: dict, name: str) -> None:
    for rank in range(2):
        took, kind, text = results[(name, rank)]
        want_kind, want = SAME[name] if name in SAME else PER_RANK[name][rank]
        assert took < CASE_LIMIT_S, (name, rank, took)
        assert kind == want_kind, (name, rank, kind, text)
        if want.startswith("re:"):
            assert re.fullmatch(want[3:], text), (name, rank, text)
        else:
            assert text == want, (name, rank, text)


def test_controls_give_every_rank_the_same_loss(results: dict) -> None:
    """The ok cases are the contract's other side: the full-batch loss on every rank, aux equal to torch.func."""
    for name in ("step_ok", "readme_seeded", "has_aux_ok", "first_checks_the_first_step_only"):
        losses = {re.search(r"loss (\d+\.\d+)", results[(name, r)][2]).group(1) for r in range(2)}
        assert len(losses) == 1, (name, losses)
