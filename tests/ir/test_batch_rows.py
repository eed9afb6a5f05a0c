"""ir.batch_rows: where each value's batch rows are, and the first op that mixes rows with each other."""
from __future__ import annotations

import inspect
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from ir_cases import examples

import ir
from engine.testing import models
from ir.batch_state import Ctx, rows

B, D = 8, 6


_MHA = nn.MultiheadAttention(6, 2, dtype=torch.float64)


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(D, D, generator=g, dtype=torch.float64),
            "v": torch.randn(D, 3, generator=g, dtype=torch.float64),
            "mha": {k: v.detach() for k, v in _MHA.named_parameters()}}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(B, D, generator=g, dtype=torch.float64)


def _emb(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"])


def contrastive(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = _emb(p, x) @ _emb(p, y).t()
    return F.cross_entropy(logits, torch.arange(len(x)))


def _mse(h: torch.Tensor) -> torch.Tensor:
    return (h ** 2).mean()


def _simclr(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = torch.cat([_emb(p, x), _emb(p, y)])  # [2B, D]: row i of the batch at i and B + i
    return F.cross_entropy(z @ z.t(), torch.arange(2 * len(x)))


# loss -> (the op that mixes, words of the reason)
MIXING: dict[str, tuple[Callable, str, str]] = {
    "contrastive (CLIP)": (contrastive, "matmul", "in dims 0 and 1"),
    "SimCLR (cat along the batch)": (_simclr, "matmul", "in dims 0 and 1"),
    "pairwise differences": (lambda p, x, y: _mse(_emb(p, x)[:, None] - _emb(p, y)[None]), "sub", "in dims 0 and 1"),
    "einsum over pairs": (lambda p, x, y: torch.einsum("bd,cd->bc", _emb(p, x), y).logsumexp(-1).mean(), "einsum",
                          "in dims 0 and 1"),
    "cdist": (lambda p, x, y: torch.cdist(_emb(p, x), y).mean(), "cdist", "in dims 0 and 1"),
    "cross-entropy over rows": (lambda p, x, y: F.cross_entropy(_emb(p, x).t(), torch.arange(D)), "cross_entropy_loss",
                                "classes in dim 1"),
    "centring by the batch mean": (lambda p, x, y: _mse((lambda h: h - h.mean(0))(_emb(p, x))), "sub",
                                   "each row of the batch with a sum or mean"),
    "softmax over the batch": (lambda p, x, y: (torch.softmax(_emb(p, x), 0) * y).sum(), "softmax", "along dim 0"),
    "cumsum over the batch": (lambda p, x, y: _mse(torch.cumsum(_emb(p, x), 0)), "cumsum", "along dim 0"),
    "sort over the batch": (lambda p, x, y: _mse(torch.sort(_emb(p, x), 0).values * y), "sort", "along dim 0"),
    "std over the batch": (lambda p, x, y: _emb(p, x).std(0).sum(), "std", "over dim 0"),
    "max over everything": (lambda p, x, y: _mse(_emb(p, x) - _emb(p, x).max()), "max", "over dim 0"),
    "product of batch means (router balance)": (lambda p, x, y: _emb(p, x).mean(0).mul(_emb(p, y).mean(0)).sum(),
                                                "mul", "2 sums or means"),
    "ratio of sums (a masked mean)": (lambda p, x, y: (_emb(p, x) ** 2 * (y > 0)).sum() / (y > 0).sum(), "div",
                                      "a ratio of sums, such as a mean over counted targets (cross_entropy with "
                                      "ignore_index"),
    "square root of a mean (RMSE)": (lambda p, x, y: F.mse_loss(_emb(p, x), y).sqrt(), "sqrt", "non-linear `sqrt`"),
    "a batch gram matrix, squared": (lambda p, x, y: (_emb(p, x).t() @ y).pow(2).sum(), "pow", "non-linear `pow`"),
    "layer norm over [B, D]": (lambda p, x, y: _mse(F.layer_norm(_emb(p, x), (B, D))), "layer_norm",
                               "normalises over dim 0"),
    "batch norm in train mode, by hand": (lambda p, x, y: _bn_train(p, x, y), "batch_norm",
                                          "statistics over all the batch's rows"),
    "SimCLR's cosine similarity of broadcast rows": (lambda p, x, y: F.cross_entropy(torch.nn.CosineSimilarity(dim=2)(
        _emb(p, x).unsqueeze(1), _emb(p, y).unsqueeze(0)), torch.arange(len(x))), "cosine_similarity",
        "in dims 0 and 1"),
    "pairwise distance of broadcast rows": (lambda p, x, y: F.pairwise_distance(_emb(p, x)[:, None], y[None]).mean(),
                                            "pairwise_distance", "in dims 0 and 1"),
    "pdist": (lambda p, x, y: torch.pdist(_emb(p, x)).mean(), "pdist", "every row's distance to every other"),
    "every pair of rows side by side (a relation network)": (lambda p, x, y: _mse(torch.tanh(torch.cat(
        [_emb(p, x)[:, None].expand(B, B, D), _emb(p, y)[None].expand(B, B, D)], -1) @ torch.cat([p["w"], p["w"]]))), "cat",
        "in dims 0 and 1"),
    "every pair of rows stacked": (lambda p, x, y: _mse(torch.stack(
        [_emb(p, x)[:, None].expand(B, B, D), _emb(p, y)[None].expand(B, B, D)], -1).prod(-1)), "stack",
        "in dims 0 and 1"),
    "outer product of two batch vectors": (lambda p, x, y: torch.outer(_emb(p, x)[:, 0], y[:, 0]).logsumexp(-1).mean(),
                                           "outer", "in dims 0 and 1"),
}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_losses_that_compare_rows_are_found_at_the_op_that_mixes(name: str) -> None:
    fn, op, words = MIXING[name]
    x, y = _batch()
    found = ir.mixed_rows(ir.trace(fn, _params(), x, y))
    assert found is not None, name
    assert found.op.split(".")[1] == op and words in found.why, str(found)


def _bn_train(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(F.batch_norm(_emb(p, x), None, None, training=True), y)


def _seq_first_attention(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """nn.MultiheadAttention's own layout: [T, B, E], heads folded into the batch ([B * H, T, d] inside)."""
    seq = _emb(p, x).view(B, 2, 3).repeat(1, 1, 2).transpose(0, 1)  # [T=2, B, E=6]
    out, _ = torch.func.functional_call(_MHA, p["mha"], (seq, seq, seq), {"need_weights": False})
    return _mse(out)


def _keyed(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with ir.keyed_dropout(ir.row_keys(3, B)):
        return F.mse_loss(F.dropout(_emb(p, x), 0.5), y)


def _ignore_index(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    labels = torch.where(y[:, 0] > 0, y[:, :3].argmax(-1), -100)
    return F.cross_entropy(_emb(p, x) @ p["v"], labels)


# losses that are means (or sums) of per-row terms: none is refused, and each loss is a tracked sum over rows
MEANS: dict[str, Callable] = {
    "mse": lambda p, x, y: F.mse_loss(_emb(p, x), y),
    "sum": lambda p, x, y: ((_emb(p, x) - y) ** 2).sum(),
    "mean plus a regulariser of the params": lambda p, x, y: F.mse_loss(_emb(p, x), y) + 0.01 * (p["w"] ** 2).sum(),
    "two means added": lambda p, x, y: F.mse_loss(_emb(p, x), y) + 0.5 * _emb(p, y).abs().mean() / 3,
    "cross-entropy with ignore_index": _ignore_index,
    "softmax over features": lambda p, x, y: (torch.softmax(_emb(p, x), -1) * y).sum(-1).mean(),
    "layer norm over features": lambda p, x, y: F.mse_loss(F.layer_norm(_emb(p, x), (D,)), y),
    "attention, batch first": lambda p, x, y: _mse(F.scaled_dot_product_attention(*(_emb(p, x).view(B, 2, 3),) * 3)),
    "attention, sequence first": _seq_first_attention,
    "einsum attention": lambda p, x, y: torch.einsum("bij,bjd->bid", torch.softmax(torch.einsum(
        "bid,bjd->bij", _emb(p, x).view(B, 2, 3), y.view(B, 2, 3)), -1), y.view(B, 2, 3)).mean(),
    "a row picked by arange (pooling)": lambda p, x, y: _emb(p, x)[torch.arange(len(x)), y.argmax(-1)].mean(),
    "[B * T, C] view for cross-entropy": lambda p, x, y: F.cross_entropy(
        (_emb(p, x) @ p["v"]).repeat_interleave(2, 0).view(B, 2, 3).flatten(0, 1), y.argmax(-1)[:, None].expand(
            B, 2).reshape(-1) % 3),
    "keyed dropout": _keyed,
    "cosine similarity of each row's pair": lambda p, x, y: (1 - F.cosine_similarity(_emb(p, x), y, dim=-1)).mean(),
    "pairwise distance of each row's pair": lambda p, x, y: F.pairwise_distance(_emb(p, x), y).mean(),
}


@pytest.mark.parametrize("name", sorted(MEANS))
def test_means_of_per_row_terms_are_not_refused_and_their_loss_is_a_sum_over_rows(name: str) -> None:
    x, y = _batch()
    g = ir.trace(MEANS[name], _params(), x, y)
    states, found = ir.batch_rows(g)
    assert found == [] and ir.mixed_rows(g) is None
    assert states[g.outputs[0]].summed, (name, str(states[g.outputs[0]]))  # tracked all the way: not given up


def _state_of(fn: Callable, *batch: torch.Tensor) -> str:
    g = ir.trace(fn, _params(), *batch)
    return str(ir.batch_rows(g)[0][g.outputs[0]])


@pytest.mark.parametrize("fn,want", [
    (lambda p, x: x.view(B, 2, 3).flatten(0, 1), "rows(0, inner=2)"),              # [B * 2, 3]
    (lambda p, x: x.view(B, 2, 3).transpose(0, 1), "rows(1)"),                     # [2, B, 3]
    (lambda p, x: x.view(B, 2, 3).transpose(0, 1).reshape(2 * B, 3), "rows(0)"),    # index i: row i % B
    (lambda p, x: x.view(B, 2, 3).permute(1, 2, 0).reshape(6, B), "rows(1)"),
    (lambda p, x: x.view(B // 2, 2, D), "unknown"),                                # the rows' dim split in two
    (lambda p, x: torch.cat([x, x]), "rows(0)"),
    (lambda p, x: torch.cat([x, x], 1), "rows(0)"),
    (lambda p, x: torch.stack([x, x], 0), "rows(1)"),
    (lambda p, x: x.repeat_interleave(3, 0), "rows(0, inner=3)"),
    (lambda p, x: x.sum(1, keepdim=True).expand(B, 4)[None], "rows(1)"),
    (lambda p, x: x[1:], "unknown"),                                               # rows picked by a constant
    (lambda p, x: x[:, 1:], "rows(0)"),
    (lambda p, x: x.sum(0), "summed"),
    (lambda p, x: p["w"] * 2, "clean"),
    (lambda p, x: torch.zeros_like(x), "clean"),
])
def test_rows_follow_views_joins_and_picks(fn: Callable, want: str) -> None:
    x, _ = _batch()
    assert _state_of(lambda p, x: fn(p, x) * p["w"].sum(), x) == want


def test_an_op_without_a_rule_makes_unknown_and_is_never_refused() -> None:
    """index_put has no rule: its output is unknown, and the [B, B] product after it is not refused (the walk
    refuses only what it can show)."""
    def fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.ops.aten.index_put(_emb(p, x), [torch.tensor([0])], torch.zeros(D, dtype=x.dtype))
        return (h @ _emb(p, y).t()).logsumexp(-1).mean()

    x, y = _batch()
    g = ir.trace(fn, _params(), x, y)
    states, found = ir.batch_rows(g)
    put = next(e for e in g.eqns if e.op == "aten.index_put.default")
    assert str(states[put.outputs[0]]) == "unknown" and found == []


def test_known_misses_rows_picked_by_a_constant() -> None:
    """Documented: neighbouring rows compared through slices (x[1:] - x[:-1]) are not followed."""
    x, y = _batch()
    assert ir.mixed_rows(ir.trace(lambda p, x, y: _mse(_emb(p, x)[1:] - _emb(p, x)[:-1]), _params(), x, y)) is None


def test_an_aux_output_that_mixes_rows_is_found_only_when_asked() -> None:
    """The loss's path decides (the grads come from it); an aux leaf is looked at apart (the engine warns)."""
    def fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return F.mse_loss(_emb(p, x), y), {"spread": _emb(p, x).std(0).mean()}

    x, y = _batch()
    g = ir.trace(fn, _params(), x, y)
    assert ir.mixed_rows(g) is None
    found = ir.mixed_rows(g, outputs=range(1, len(g.outputs)))
    assert found is not None and found.op.startswith("aten.std.")


def test_train_mode_batch_norm_is_the_engines_own_only_in_functionalized_modules() -> None:
    """`own_norms` (a function engine.functionalize made, its BatchNorm run per microbatch by the engine): the
    output keeps its rows and the loss is a sum over them; by hand, the same op mixes rows."""
    x, y = _batch()
    g = ir.trace(_bn_train, _params(), x, y)
    assert ir.mixed_rows(g, own_norms=True) is None
    states, found = ir.batch_rows(g, own_norms=True)
    assert found == [] and states[g.outputs[0]].summed
    assert ir.mixed_rows(g) is not None


def test_the_refusal_names_the_op_its_shapes_and_with_lines_its_source_line() -> None:
    x, y = _batch()
    found = ir.mixed_rows(ir.trace(contrastive, _params(), x, y, lines=True))
    line = inspect.getsourcelines(contrastive)[1] + 1
    where = (f"\n  at test_batch_rows.py:{line} in contrastive: logits = _emb(p, x) @ _emb(p, y).t()"
             if hasattr(torch.fx.proxy, "_register_stack_trace_anchor") else "")  # torch < 2.13: no plain lines
    assert str(found) == (
        "`matmul` (equation 5: f64[8,6], f64[6,8] -> f64[8,8]) pairs the batch's rows: its output has them in dims "
        f"0 and 1, every row against every other{where}")
    assert ir.mixed_rows(ir.trace(contrastive, _params(), x, y)).source == ""  # lines only when asked


def test_ctx_reads_arguments_by_schema_name() -> None:
    x, _ = _batch()
    g = ir.trace(lambda p, x: (x @ p["w"]).softmax(-1).sum(), _params(), x)
    e = next(e for e in g.eqns if e.op == "aten.softmax.int")
    states, _ = ir.batch_rows(g)
    c = Ctx(e, B, states)
    assert c.arg("dim") == -1 and c.state(e.args[0]) == rows(0) and c.state(3.0).clean


@settings(max_examples=examples(40), deadline=None)
@given(models(max_layers=8))
def test_every_drawn_model_is_a_mean_the_walk_follows_to_the_loss(case) -> None:
    """engine.testing's random models (attention, layer norms, skips, tied weights, a second stream, batch
    inputs used mid-model) are means over the batch: none is refused, and each loss is a tracked sum."""
    g = ir.trace(case.fn, case.params, *case.batch)
    states, found = ir.batch_rows(g)
    assert found == [] and states[g.outputs[0]].summed, (case, found, str(states[g.outputs[0]]))
