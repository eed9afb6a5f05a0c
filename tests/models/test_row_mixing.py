"""transformers' losses that compare rows (CLIP's contrastive loss, Mixtral's router balance) are refused when the
batch would be cut (engine/planning/rows.py); the zoo's models are means over the batch and are not."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
import ir
from engine.testing import ModelCase, assert_parallel_equivalent
from tests.models.test_refusals import moe_model
from tests.models.zoo import BATCH, FAMILIES, _ids, _quiet_transformers


class ClipLoss(nn.Module):
    """CLIPModel with its own contrastive loss (`return_loss=True`)."""

    def __init__(self) -> None:
        super().__init__()
        T = _quiet_transformers()
        torch.manual_seed(0)
        text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    max_position_embeddings=16)
        vision = dict(image_size=8, patch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2)
        self.clip = T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.clip(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


def clip_case() -> ModelCase:
    fn, variables = engine.functionalize(ClipLoss().double().eval(), inputs=2)
    images = torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return ModelCase(fn, variables, (_ids(1), images), "CLIP (return_loss=True)", torch.float64)


def test_clip_loss_is_not_the_mean_of_its_microbatches() -> None:
    made = clip_case()
    ids, images = made.batch
    full = made.fn(made.params, ids, images)
    parts = torch.stack([made.fn(made.params, i, x) for i, x in zip(ids.chunk(4), images.chunk(4))]).mean()
    assert abs(float(parts - full)) > 0.1 * abs(float(full))


def test_clip_with_microbatches_is_refused_at_its_logits() -> None:
    made = clip_case()
    with pytest.raises(engine.InputError) as caught:
        engine.parallelize(made.fn, made.params, *made.batch, microbatches=4)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("the loss compares rows of the batch with each other, so cutting its 8 rows into 1 dp "
                               "replica x 4 microbatches")
    assert lines[1].startswith("`matmul` (equation") and "pairs the batch's rows" in lines[1]
    assert "modeling_clip.py" in lines[2] and "matmul" in lines[2], lines[2]
    assert lines[3].startswith("Fix: run it on the whole batch, parallelize(..., microbatches=1, dp=1)")


def test_clip_as_one_microbatch_through_two_stages_equals_torch_func() -> None:
    assert assert_parallel_equivalent(clip_case(), microbatches=1, stages=2).max_rel_error < 1e-10


def _mixtral(router_logits: bool) -> ModelCase:
    model = moe_model("mixtral", "batched_mm")
    model.config.output_router_logits = router_logits
    fn, variables = engine.functionalize(model, inputs=("input_ids", "labels"))
    ids = _ids(1)
    return ModelCase(fn, variables, (ids, ids), f"Mixtral (output_router_logits={router_logits})", torch.float64)


def test_mixtral_router_balance_is_refused_at_the_product_of_its_means() -> None:
    made = _mixtral(True)
    with pytest.raises(engine.InputError) as caught:
        engine.parallelize(made.fn, made.params, *made.batch, microbatches=2)
    lines = str(caught.value).splitlines()
    assert lines[1].startswith("`mul` (equation") and lines[1].endswith(
        "combines 2 sums or means over the batch's rows (made by `histc` and `sum`) non-linearly, so the mean of each "
        "microbatch's result is not the result of the batch's means (a load-balancing loss)"), lines[1]
    assert "modeling_mixtral.py" in lines[2], lines[2]


def test_mixtral_router_balance_is_exact_as_one_microbatch() -> None:
    assert assert_parallel_equivalent(_mixtral(True), microbatches=1, stages=2).max_rel_error < 1e-10


def test_mixtral_without_the_router_loss_is_a_mean() -> None:
    made = _mixtral(False)
    g = ir.trace(made.fn, made.params, *(x[:2] for x in made.batch))
    states, found = ir.batch_rows(g)
    assert found == [] and states[g.outputs[0]].summed


@pytest.mark.parametrize("family,dropout", [(f, d) for f in sorted(FAMILIES) for d in (False, True)
                                             if not (f == "cnn" and d)])  # the CNN has no dropout
def test_zoo_losses_are_means_followed_to_the_loss(family: str, dropout: bool) -> None:
    """Every zoo model's loss is a sum over rows the walk followed to the end (never refused, never given up)."""
    made = FAMILIES[family](dropout=dropout)
    g = ir.trace(made.fn, made.params, *(x[:2] for x in made.batch))
    states, found = ir.batch_rows(g)
    assert found == [] and states[g.outputs[0]].summed, (family, found, str(states[g.outputs[0]]))
