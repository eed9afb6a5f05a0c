"""engine.functionalize for models as Hugging Face writes them: keyword inputs, ModelOutput results, the
model's own loss from `labels` or a user loss on one output field, and train-mode dropout keyed by rows."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_outputs import SequenceClassifierOutput

import ir
from engine.testing import assert_parallel_equivalent
from engine.training.module import ModuleError, functionalize


class Classifier(nn.Module):
    """Returns a ModelOutput like transformers: `loss` only when `labels` are given."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(6, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.drop(self.embed(input_ids))
        mask = attention_mask.unsqueeze(-1).to(h.dtype) if attention_mask is not None else torch.ones_like(h[..., :1])
        logits = self.head((h * mask).sum(1) / mask.sum(1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def batch(n: int = 8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (n, 5), generator=g)
    mask = (torch.arange(5) < torch.randint(1, 6, (n, 1), generator=g)).long()
    return ids, mask, torch.randint(0, 3, (n,), generator=g)


def params_only(fn, variables):
    return (lambda params, *b: fn({"params": params, "buffers": variables["buffers"]}, *b)), variables["params"]


def test_keyword_inputs_and_the_models_own_loss():
    model = Classifier().double()
    ids, mask, labels = batch()
    fn, variables = functionalize(model, inputs=("input_ids", "attention_mask", "labels"))
    assert list(inspect.signature(fn).parameters)[:4] == ["variables", "input_ids", "attention_mask", "labels"]
    assert torch.equal(fn(variables, ids, mask, labels), model(ids, attention_mask=mask, labels=labels).loss)
    assert ir.trace(fn, variables, ids, mask, labels).input_names[-3:] == ("input_ids", "attention_mask", "labels")
    assert_parallel_equivalent(*params_only(fn, variables), ids, mask, labels, schedule="zb-h1", rtol=1e-12)


def test_user_loss_on_one_output_field():
    model = Classifier().double()
    ids, mask, labels = batch()
    smooth = lambda logits, y: F.cross_entropy(logits, y, label_smoothing=0.1)  # noqa: E731
    fn, variables = functionalize(model, loss=smooth, inputs=("input_ids", "attention_mask"), output="logits")
    assert torch.equal(fn(variables, ids, mask, labels), smooth(model(ids, attention_mask=mask).logits, labels))
    fn2, _ = functionalize(model, loss=lambda out, y: smooth(out.logits, y), inputs=("input_ids", "attention_mask"))
    assert torch.equal(fn2(variables, ids, mask, labels), fn(variables, ids, mask, labels))
    assert_parallel_equivalent(*params_only(fn, variables), ids, mask, labels, schedule="zbv", stages=4, rtol=1e-12)


def test_missing_loss_and_bad_names_say_the_fix():
    model = Classifier().double()
    ids, mask, labels = batch()
    fn, variables = functionalize(model, inputs=("input_ids", "attention_mask"))
    with pytest.raises(ModuleError, match=r"returned \['logits'\] without one: pass its labels among `inputs`"):
        fn(variables, ids, mask)
    fn, variables = functionalize(model, loss=F.cross_entropy, inputs=("input_ids",), output="hidden")
    with pytest.raises(ModuleError, match=r"output='hidden': Classifier returned \['logits'\]; name one of its fields"):
        fn(variables, ids, labels)
    with pytest.raises(ModuleError, match=r"inputs='input_ids': pass a tuple of names, e.g. inputs=\('input_ids',\)"):
        functionalize(model, inputs="input_ids")
    with pytest.raises(ModuleError, match="distinct"):
        functionalize(model, inputs=("input_ids", "input_ids"))


def test_train_mode_dropout_with_rng_equals_one_process_under_any_layout():
    model = Classifier(p=0.3).double().train()
    ids, mask, labels = batch(16)
    with pytest.raises(ModuleError, match="rng=True"):
        functionalize(model, inputs=("input_ids", "attention_mask", "labels"))
    fn, variables = functionalize(model, inputs=("input_ids", "attention_mask", "labels"), rng=True)
    keys = ir.row_keys(5, 16)
    assert list(inspect.signature(fn).parameters)[-1] == "rng"
    loss = fn(variables, ids, mask, labels, keys)
    assert torch.equal(loss, fn(variables, ids, mask, labels, keys))  # pure
    assert not torch.equal(loss, fn(variables, ids, mask, labels, ir.row_keys(6, 16)))  # the seed matters
    model.eval()
    assert not torch.equal(loss, fn(variables, ids, mask, labels, keys))  # and dropout really dropped
    model.train()
    f, p = params_only(fn, variables)
    for schedule, stages, dp in (("1f1b", 2, 2), ("interleaved-1f1b", 4, 1), ("zbv", 4, 1)):
        assert_parallel_equivalent(f, p, ids, mask, labels, keys, schedule=schedule, stages=stages, dp=dp,
                                   rtol=1e-12)


def test_a_missing_keys_argument_is_named():
    model = Classifier(p=0.3).double().train()
    ids, mask, labels = batch()
    fn, variables = functionalize(model, inputs=("input_ids", "attention_mask", "labels"), rng=True)
    with pytest.raises(ModuleError, match=r"exactly 4 batch arguments expected, got 3: 3 for inputs .*"
                                          r"then ir.row_keys\(seed, batch_size\) last \(rng=True\)"):
        fn(variables, ids, mask, labels)
    fn, variables = functionalize(model, loss=F.cross_entropy, inputs=("input_ids",), output="logits", rng=True)
    with pytest.raises(ModuleError, match="at least 2 batch arguments expected, got 1"):
        fn(variables, ids)
