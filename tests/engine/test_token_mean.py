"""A loss averaged over the targets it counts (cross-entropy with ignore_index): the pipelined step equals one
process whatever the padding, by weighting each microbatch's loss by its count (engine/execution/loss_weights.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import engine
import ir
from engine.execution.inprocess import build_steps, run_steps
from engine.testing import assert_parallel_equivalent
from ir.token_mean import token_mean

V, D = 11, 8


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"emb": rnd(V, D), "w": [rnd(D, D) / 3 for _ in range(4)], "head": rnd(D, V)}


def _logits(p: dict, tokens: torch.Tensor) -> torch.Tensor:
    h = p["emb"][tokens]
    for w in p["w"]:
        h = h + torch.tanh(h @ w)
    return h @ p["head"]


def lm_loss(p: dict, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, padding labelled -100 (Hugging Face's recipe)."""
    return F.cross_entropy(_logits(p, tokens)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def _batch(pad_rows: dict[int, int], rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (rows, 6), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    for row, start in pad_rows.items():
        labels[row, start:] = -100
    return tokens, labels


UNEVEN = {0: 2, 1: 4, 5: 2, 6: 3}  # every microbatch of 1, 2 or 4 rows keeps at least one target


def test_the_uneven_batch_is_a_real_test() -> None:
    """The mean of the microbatches' means is not the batch's mean here: unweighted, the step would be wrong."""
    p, (tokens, labels) = _params(), _batch(UNEVEN)
    full = lm_loss(p, tokens, labels)
    per = torch.stack([lm_loss(p, t, y) for t, y in zip(tokens.chunk(4), labels.chunk(4))]).mean()
    assert abs(float(per - full)) > 1e-3 * abs(float(full))


@pytest.mark.parametrize("schedule,stages,dp,m", [("gpipe", 2, 2, 2), ("1f1b", 2, 1, 4), ("1f1b", 2, 2, 4),
                                                   ("zb-h1", 2, 1, 8), ("zbv", 4, 1, 4),
                                                   ("interleaved-1f1b", 4, 2, 2)])
def test_padded_labels_equal_torch_func_grad_on_the_full_batch(schedule: str, stages: int, dp: int, m: int) -> None:
    tokens, labels = _batch(UNEVEN, rows=16 if dp * m > 8 else 8)
    eq = assert_parallel_equivalent(lm_loss, _params(), tokens, labels, schedule=schedule, stages=stages, dp=dp,
                                    microbatches=m)
    assert eq.max_rel_error < 1e-12


def test_weights_as_a_device_tensor_give_the_same_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch on a GPU gets its weights as a tensor there, made without a sync: the executor's path for
    them, here on the CPU."""
    from engine.execution import step as step_module

    def as_tensor(mean, chunks):  # what loss_weights returns for a batch on an accelerator
        counts = mean.counts(chunks)[0]
        return counts.double() / counts.sum()

    monkeypatch.setattr(step_module, "loss_weights", as_tensor)
    tokens, labels = _batch(UNEVEN)
    eq = assert_parallel_equivalent(lm_loss, _params(), tokens, labels, schedule="zbv", stages=4, microbatches=4)
    assert eq.max_rel_error < 1e-12


def test_a_counted_mean_times_constants_is_weighted_and_aux_stays_uniform() -> None:
    def fn(p: dict, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lm_loss(p, tokens, labels) * 0.5, _logits(p, tokens).mean()

    params, (tokens, labels) = _params(), _batch(UNEVEN)
    plan = engine.plan(fn, params, tokens, labels, world_size=2, schedule="1f1b", stages=2, microbatches=4,
                       has_aux=True)
    result = run_steps(build_steps(fn, params, (tokens, labels), plan, has_aux=True), params, (tokens, labels))
    grads, (loss, aux) = torch.func.grad_and_value(fn, has_aux=True)(params, tokens, labels)
    (got_loss, got_aux) = result.loss
    assert torch.allclose(got_loss, loss, rtol=1e-12, atol=0) and torch.allclose(got_aux, aux, rtol=1e-12, atol=0)
    for got, want in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(grads)):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-14)


def test_a_counted_mean_mixed_with_other_terms_is_refused_when_counts_differ() -> None:
    def fn(p: dict, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(p, tokens, labels) + 0.1 * _logits(p, tokens).pow(2).mean()

    params = _params()
    tokens, labels = _batch(UNEVEN)
    step = engine.parallelize(fn, params, tokens, labels, microbatches=4)
    with pytest.raises(engine.InputError, match=r"count 4, 10, 6, 7 of them, and the loss combines"):
        step(step.shard(params), tokens, labels)
    even_tokens, even_labels = _batch({0: 3, 2: 3, 4: 3, 6: 3})  # as many targets in every microbatch: exact as is
    assert_parallel_equivalent(fn, params, even_tokens, even_labels, microbatches=4, stages=2)


def test_a_microbatch_without_targets_is_refused() -> None:
    params = _params()
    tokens, labels = _batch({0: 1, 1: 1})  # the first microbatch of two rows: every label ignored after the shift
    step = engine.parallelize(lm_loss, params, tokens, labels, microbatches=4)
    with pytest.raises(engine.InputError, match="microbatch 0 counts none"):
        step(step.shard(params), tokens, labels)


def test_several_counted_means_or_class_weights_are_refused() -> None:
    params, (tokens, labels) = _params(), _batch(UNEVEN)

    def two(p: dict, t: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        logits = _logits(p, t).reshape(-1, V)
        return F.cross_entropy(logits, y.reshape(-1)) + F.cross_entropy(logits, z.reshape(-1))

    step = engine.parallelize(two, params, tokens, tokens, labels, microbatches=4)  # the first mean is even
    with pytest.raises(engine.InputError, match="one of its several counted means"):
        step(step.shard(params), tokens, tokens, labels)

    def weighted(p: dict, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = torch.linspace(0.5, 1.5, V, dtype=torch.float64)
        return F.cross_entropy(_logits(p, t).reshape(-1, V), y.reshape(-1), weight=w)

    step = engine.parallelize(weighted, params, tokens, tokens, microbatches=4)  # no padding: still a ratio of sums
    with pytest.raises(engine.InputError, match="with class weights"):
        step(step.shard(params), tokens, tokens)


def test_non_contiguous_labels_are_counted_as_the_step_reads_them() -> None:
    """T5 and BART call `labels.view(-1)`; a column slice of a wider buffer is not contiguous."""
    def loss(p: dict, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_logits(p, t).view(-1, V), y.view(-1))

    params, (tokens, labels) = _params(), _batch(UNEVEN)
    wide = torch.full((8, 12), -100)
    wide[:, :6] = labels
    plan = engine.plan(loss, params, tokens, labels, world_size=2, schedule="1f1b", stages=2, microbatches=4)
    result = run_steps(build_steps(loss, params, (tokens, labels), plan), params, (tokens, wide[:, :6]))
    grads, want = torch.func.grad_and_value(loss)(params, tokens, labels)  # eager's view needs them contiguous
    assert torch.allclose(result.loss, want, rtol=1e-12, atol=0)
    for got, ref in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(grads)):
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-14)


def test_batchnorm_with_padded_labels_matches_the_weighted_microbatched_reference() -> None:
    """engine.testing's reference for a deferred (BatchNorm) function weights its microbatches as the step does."""
    from tests.mpi.batchnorm import batch, bn_net

    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch(16)
    y = y.clone()
    y[[0, 1, 2, 5, 9]] = -100  # 4 microbatches of 4 rows count 1, 3, 3, 4 targets
    eq = assert_parallel_equivalent(fn, variables, x, y, schedule="1f1b", stages=2, microbatches=4)
    assert eq.max_rel_error < 1e-12


def _found(fn, *batch) -> object:
    return token_mean(ir.trace(fn, _params(), *batch))


def test_what_counts_as_a_counted_mean() -> None:
    tokens, labels = _batch(UNEVEN)
    logits = lambda p, t: _logits(p, t).reshape(-1, V)  # noqa: E731
    assert _found(lambda p, t, y: F.cross_entropy(logits(p, t), y.reshape(-1)) / 3, tokens, labels).exact
    assert _found(lambda p, t, y: -F.nll_loss(torch.log_softmax(logits(p, t), -1), y.reshape(-1)) * 2,
                  tokens, labels).exact
    ce = lambda p, t, y: F.cross_entropy(logits(p, t), y.reshape(-1))  # noqa: E731
    assert _found(lambda p, t, y: ce(p, t, y).mean(), tokens, labels).exact  # DataParallel's defensive .mean()
    assert _found(lambda p, t, y: torch.tensor(0.5, dtype=torch.float64) * ce(p, t, y), tokens, labels).exact
    assert _found(lambda p, t, y: ce(p, t, y).unsqueeze(0).squeeze(0), tokens, labels).exact
    assert _found(lambda p, t, y: F.cross_entropy(logits(p, t), y.reshape(-1), label_smoothing=0.1), tokens,
                  labels).exact
    assert _found(lambda p, t, y: F.cross_entropy(logits(p, t), y.reshape(-1), reduction="none").mean(), tokens,
                  labels) is None  # a mean over every row: uniform weights are exact
    mixed = _found(lambda p, t, y: F.cross_entropy(logits(p, t), y.reshape(-1)) + p["head"].sum(), tokens, labels)
    assert mixed is not None and not mixed.exact
    assert _found(lambda p, t, y: F.cross_entropy(logits(p, t), y.reshape(-1), reduction="sum"), tokens, labels) is None
    probs = torch.softmax(torch.randn(8 * 6, V, dtype=torch.float64), -1)
    assert _found(lambda p, t, q: F.cross_entropy(logits(p, t), q), tokens, probs) is None
    found = _found(lambda p, t, y: F.cross_entropy(logits(p, t), y.reshape(-1), ignore_index=3), tokens, labels)
    assert found.ignore_index == 3 and found.counts([[tokens, labels]]).tolist() == [[int((labels != 3).sum())]]


def test_a_hugging_face_causal_lm_with_its_own_loss_and_padding() -> None:
    """Qwen2 with `labels` (padding -100): transformers computes the loss in float32, hence the tolerance;
    unweighted, the pipeline's grads were up to 26 % off (2026-11-26)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.Qwen2ForCausalLM(config).double().train()
    fn, variables = engine.functionalize(model, inputs=("input_ids", "attention_mask", "labels"))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (16, 12), generator=g)
    mask = (torch.arange(12) < torch.randint(4, 13, (16, 1), generator=g)).long()
    labels = torch.where(mask.bool(), ids, -100)
    eq = assert_parallel_equivalent(fn, variables, ids, mask, labels, schedule="1f1b", stages=2, microbatches=4,
                                    rtol=1e-5)
    assert eq.max_rel_error < 1e-5
