"""A loss that compares the batch's rows (engine/planning/rows.py): refused when the batch would be cut, exact whole.

The step averages the losses of its microbatches (and dp shares); for a contrastive loss that average is not
the batch's loss, so planning a cut batch raises InputError naming the op, its line and the fix, "auto"
counts plan one microbatch, and with microbatches=1 and dp=1 the step equals torch.func on the batch.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import engine
import ir
from engine.execution.inprocess import build_steps
from engine.testing import assert_parallel_equivalent
from examples import gpt_model, llama_model
from tests.mpi.batchnorm import batch as bn_batch
from tests.mpi.batchnorm import bn_net


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"wa": torch.randn(6, 4, generator=g, dtype=torch.float64),
            "wb": torch.randn(5, 4, generator=g, dtype=torch.float64),
            "scale": torch.tensor(2.0, dtype=torch.float64)}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 5, generator=g, dtype=torch.float64)


def contrastive(p: dict, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """CLIP's loss, by hand: every image scored against every text of the batch, both ways."""
    a = F.normalize(torch.tanh(images @ p["wa"]), dim=-1)
    b = F.normalize(torch.tanh(texts @ p["wb"]), dim=-1)
    logits = p["scale"] * a @ b.t()
    target = torch.arange(len(images))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def per_row(p: dict, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """The same shapes, a mean of per-row terms."""
    return ((torch.tanh(images @ p["wa"]) - torch.tanh(texts @ p["wb"])) ** 2).mean() * p["scale"]


LINE = inspect.getsourcelines(contrastive)[1] + 4  # logits = p["scale"] * a @ b.t()
LINES = hasattr(torch.fx.proxy, "_register_stack_trace_anchor")  # how ir.trace keeps a plain function's lines


def test_the_contrastive_loss_is_not_the_mean_of_its_microbatches() -> None:
    """What the refusal prevents: averaged over 4 microbatches the loss is another number."""
    p, (x, y) = _params(), _batch()
    full = contrastive(p, x, y)
    parts = torch.stack([contrastive(p, a, b) for a, b in zip(x.chunk(4), y.chunk(4))]).mean()
    assert abs(float(parts - full)) > 0.1 * abs(float(full))


def test_microbatches_refuse_it_naming_the_op_the_line_and_the_fix() -> None:
    p, (x, y) = _params(), _batch()
    with pytest.raises(engine.InputError) as caught:
        engine.parallelize(contrastive, p, x, y, microbatches=4)
    text = str(caught.value)
    assert text.splitlines() == [
        "the loss compares rows of the batch with each other, so cutting its 8 rows into 1 dp replica x 4 "
        "microbatches would give wrong numbers: the step averages the parts' losses, which is the batch's loss only "
        "for a mean (or sum) of per-row terms.",
        "`matmul` (equation 14: f64[2,4], f64[4,2] -> f64[2,2]) pairs the batch's rows: its output has them in dims "
        "0 and 1, every row against every other",
        *([f"  at test_rows_refused.py:{LINE} in contrastive: logits = p[\"scale\"] * a @ b.t()"] if LINES else []),
        "Fix: run it on the whole batch, parallelize(..., microbatches=1, dp=1) (pipeline stages still split the "
        "model), or make the loss a mean of per-row terms"]


def test_dp_replicas_refuse_it_too() -> None:
    p, (x, y) = _params(), _batch()
    with pytest.raises(engine.InputError, match="cutting its 8 rows into 2 dp replicas x 1 microbatch would"):
        engine.plan(contrastive, p, x, y, world_size=2, stages=1, dp=2, microbatches=1)


def test_one_microbatch_equals_torch_func_grad_on_the_batch() -> None:
    p, (x, y) = _params(), _batch()
    step = engine.parallelize(contrastive, p, x, y, microbatches=1)
    loss, grads = step(step.shard(p), x, y)
    ref_grads, ref = torch.func.grad_and_value(contrastive)(p, x, y)
    assert torch.allclose(loss, ref, rtol=1e-13, atol=0)
    for got, want in zip(pytree.tree_leaves(grads), pytree.tree_leaves(ref_grads)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)


def test_one_microbatch_through_a_pipeline_of_two_stages_equals_torch_func() -> None:
    p, (x, y) = _params(), _batch()
    assert assert_parallel_equivalent(contrastive, p, x, y, microbatches=1, stages=2).max_rel_error < 1e-12


@pytest.mark.parametrize("options", [dict(microbatches="auto"), dict(microbatches="auto", dp="auto")])
def test_auto_counts_plan_the_batch_whole(options: dict) -> None:
    p, (x, y) = _params(), _batch()
    plan = engine.plan(contrastive, p, x, y, world_size=2, **options)
    assert (plan.microbatches, plan.dp) == (1, 1)
    cut = engine.plan(per_row, p, x, y, world_size=2, **options)  # the per-row loss is cut as before
    assert cut.microbatches * cut.dp > 1


def test_auto_counts_under_a_schedule_that_needs_several_microbatches_say_why() -> None:
    """interleaved-1f1b needs a multiple of p microbatches: the batch kept whole cannot run, and the error says
    that the loss comparing rows is why (not only "use 2 microbatches", which would itself be refused)."""
    p, (x, y) = _params(), _batch()
    with pytest.raises(engine.SplitError, match="the loss compares rows of the batch, so the batch is kept whole.*"
                                               "interleaved-1f1b cannot run it"):
        engine.plan(contrastive, p, x, y, world_size=2, schedule="interleaved-1f1b", stages_per_rank=2,
                    microbatches="auto")


def test_a_plan_made_for_another_function_is_refused_for_it() -> None:
    """A plan from a cache or made by hand is checked when its artefacts are built (`planned_from`)."""
    p, (x, y) = _params(), _batch()
    plan = engine.plan(per_row, p, x, y, world_size=2, microbatches=2, schedule="1f1b")
    with pytest.raises(engine.InputError, match="1 dp replica x 2 microbatches"):
        build_steps(contrastive, p, (x, y), plan)


def _gpt() -> tuple[Callable, Any, tuple]:
    config = gpt_model.GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, head_dim=8)
    return gpt_model.make_loss_fn(config), gpt_model.init_params(config), gpt_model.example_batch(config, 8)


def _llama() -> tuple[Callable, Any, tuple]:
    config = llama_model.CONFIGS["tiny"]
    fn, variables = engine.functionalize(llama_model.build(config), loss=llama_model.lm_loss)
    return fn, variables, llama_model.example_batch(config, 8)


def _bn_resnet() -> tuple[Callable, Any, tuple]:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    return fn, variables, bn_batch()


def _keyed_dropout() -> tuple[Callable, Any, tuple]:
    def fn(p: dict, x: torch.Tensor, y: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        with ir.keyed_dropout(keys):
            return F.mse_loss(F.dropout(torch.tanh(x @ p["wa"]), 0.2) @ p["wb"].t(), y)

    x, y = _batch()
    return fn, _params(), (x, y, ir.row_keys(5, 8))


def _token_mean() -> tuple[Callable, Any, tuple]:
    def fn(p: dict, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.tanh(x @ p["wa"]), labels)  # padding -100 ignored

    x, _ = _batch()
    labels = torch.tensor([0, 1, -100, 3, 2, -100, -100, 1])
    return fn, _params(), (x, labels)


NEGATIVE: dict[str, Callable[[], tuple[Callable, Any, tuple]]] = {
    "gpt example": _gpt, "llama example": _llama, "BatchNorm ResNet in train mode": _bn_resnet,
    "keyed dropout": _keyed_dropout, "cross-entropy with ignore_index": _token_mean,
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_means_over_the_batch_are_still_cut_into_microbatches(name: str) -> None:
    fn, params, batch = NEGATIVE[name]()
    has_aux = name.startswith("BatchNorm")
    plan = engine.plan(fn, params, *batch, world_size=2, microbatches=4, has_aux=has_aux, min_microbatch_size=1)
    assert plan.microbatches == 4
    parts = ir.deferred_of(fn)
    g = ir.trace(parts.local if parts is not None else fn, params, *(x[:2] for x in batch))
    states, found = ir.batch_rows(g, own_norms=parts is not None)  # functionalize's BatchNorm: the engine's own
    assert found == [] and states[g.outputs[0]].summed  # followed to the loss, not given up on the way


def test_train_mode_batch_norm_by_hand_is_refused_and_functionalized_batchnorm_is_not() -> None:
    """F.batch_norm(training=True) written in a loss normalises with the whole batch's statistics (4 microbatches
    give other numbers); engine.functionalize's BatchNorm is run per microbatch by the engine (planned above)."""
    def by_hand(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(F.batch_norm(torch.tanh(x @ p["wa"]), None, None, training=True), y[:, :4])

    p, (x, y) = _params(), _batch()
    parts = torch.stack([by_hand(p, a, b) for a, b in zip(x.chunk(4), y.chunk(4))]).mean()
    assert abs(float(parts - by_hand(p, x, y))) > 1e-3  # what the refusal prevents
    with pytest.raises(engine.InputError, match="batch_norm.*statistics over all the batch's rows"):
        engine.plan(by_hand, p, x, y, world_size=2, microbatches=4)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_aux_metric_that_mixes_rows_is_averaged_with_a_warning_not_refused() -> None:
    """`(loss, {"max": logits.max()})`: the loss and grads are exact, the aux is the parts' average (logged)."""
    def fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        h = torch.tanh(x @ p["wa"]) @ p["wb"].t()
        return F.mse_loss(h, y), {"max": h.max().detach()}

    p, (x, y) = _params(), _batch()
    records, logger = _Records(), logging.getLogger("engine.plan")
    logger.addHandler(records)
    try:
        plan = engine.plan(fn, p, x, y, world_size=2, microbatches=4, has_aux=True)
    finally:
        logger.removeHandler(records)
    assert plan.microbatches == 4
    assert any("an aux output mixes rows" in m and "max" in m for m in records.messages), records.messages
