"""ir.check_loss: a loss is one floating-point scalar that depends on a param; has_aux adds float aux leaves."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import ir

CONTRACT = ("the loss function must return one floating-point scalar tensor (0-dim: a mean over the batch) that "
            "depends on the params")


def _args() -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 2, generator=g), "s": torch.randn((), generator=g)}, torch.randn(8, 4, generator=g), \
        torch.randn(8, 2, generator=g)


def _check(fn: Callable, *, has_aux: bool = False) -> ir.Graph:
    fn.__name__ = "loss_fn"
    return ir.check_loss(ir.trace(fn, *_args()), has_aux=has_aux, name="loss_fn")


def _refused(fn: Callable, *, has_aux: bool = False) -> str:
    with pytest.raises(ir.TraceError) as caught:
        _check(fn, has_aux=has_aux)
    return str(caught.value)


@pytest.mark.parametrize("fn,message", [
    (lambda p, x, y: ((x @ p["w"] - y) ** 2).sum(1),
     f"loss_fn returns a loss of shape f32[8] (traced on a microbatch of 8 rows), not a scalar; {CONTRACT}: reduce it "
     "over the batch, e.g. `.mean()`"),
    (lambda p, x, y: (F.mse_loss(x @ p["w"], y), (x @ p["w"]).mean()),
     f"loss_fn returns a tuple of 2 tensors (f32[], f32[]); {CONTRACT}. To return auxiliary values too, pass "
     "has_aux=True and return (loss, aux), aux a pytree of float tensors; step(...) then returns ((loss, aux), grads)"),
    (lambda p, x, y: (x @ p["w"] > y).sum(),
     f"loss_fn returns a loss of type i64[]; {CONTRACT}: an integer or bool value has no gradient; compute the loss in "
     "floating point"),
    (lambda p, x, y: (x @ p["w"] > y).all(),
     f"loss_fn returns a loss of type bool[]; {CONTRACT}: an integer or bool value has no gradient; compute the loss "
     "in floating point"),
    (lambda p, x, y: F.mse_loss(x[:, :2], y),
     f"loss_fn's loss does not depend on any param (it is computed from the batch alone, or through detach), so every "
     f"grad would be zero; {CONTRACT}"),
    (lambda p, x, y: F.mse_loss((x @ p["w"]).detach(), y),
     f"loss_fn's loss does not depend on any param (it is computed from the batch alone, or through detach), so every "
     f"grad would be zero; {CONTRACT}"),
    (lambda p, x, y: p["s"], f"loss_fn returns its input 's' unchanged as the loss; {CONTRACT}"),
])
def test_what_is_not_a_loss_is_refused_with_the_contract(fn: Callable, message: str) -> None:
    assert _refused(fn) == message


@pytest.mark.parametrize("fn,message", [
    (lambda p, x, y: F.mse_loss(x @ p["w"], y),
     "loss_fn returns a single tensor, but has_aux=True asks for a pair (loss, aux): the loss a floating-point scalar "
     "tensor, aux a pytree of float tensors; return (loss, aux), or drop has_aux"),
    (lambda p, x, y: (F.mse_loss(x @ p["w"], y), x.mean(), x.sum()),
     "loss_fn returns a tuple of 3 tensors, but has_aux=True asks for a pair (loss, aux): the loss a floating-point "
     "scalar tensor, aux a pytree of float tensors; return (loss, aux), or drop has_aux"),
    (lambda p, x, y: (F.mse_loss(x @ p["w"], y), {"hits": (x @ p["w"] > 0).sum()}),
     "loss_fn returns 'aux.hits' as i64[]; aux leaves are averaged over the microbatches like the loss, so they must "
     "be floating-point: `.float()` a count (its average is then the mean over the batch)"),
    (lambda p, x, y: (F.mse_loss(x @ p["w"], y), {"w": p["w"]}),
     "loss_fn returns its input 'w' unchanged as 'aux.w'; return a value computed from it instead (e.g. `.detach()` of "
     "it)"),
    (lambda p, x, y: (((x @ p["w"] - y) ** 2).mean(1), {}),
     f"loss_fn returns a loss of shape f32[8] (traced on a microbatch of 8 rows), not a scalar; {CONTRACT}: reduce it "
     "over the batch, e.g. `.mean()`"),
])
def test_has_aux_needs_a_pair_of_a_loss_and_float_tensors(fn: Callable, message: str) -> None:
    assert _refused(fn, has_aux=True) == message


def test_a_non_tensor_output_names_the_loss_contract() -> None:
    with pytest.raises(ir.TraceError, match=r"the function returns 3; every output leaf must be a tensor: a loss "
                                            r"function returns one scalar tensor, or \(loss, aux\) with has_aux=True"):
        ir.trace(lambda p, x, y: (F.mse_loss(x @ p["w"], y), {"n": 3}), *_args())


def _aux_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
    out = x @ p["w"]
    return F.mse_loss(out, y), {"mae": (out - y).abs().mean(), "rows": [out.mean(0), p["s"].detach()]}


def test_an_aux_graph_outputs_the_loss_then_the_aux_leaves_by_name() -> None:
    g = _check(_aux_fn, has_aux=True)
    assert ir.returns_aux(g) and not ir.returns_aux(_check(lambda p, x, y: F.mse_loss(x @ p["w"], y)))
    assert ir.aux_names(g) == ("aux.mae", "aux.rows.0", "aux.rows.1")
    assert [str(v.aval) for v in g.outputs] == ["f32[]", "f32[]", "f32[2]", "f32[]"]
    loss, aux = ir.evaluate(g, *_args())
    ref_loss, ref_aux = _aux_fn(*_args())
    assert torch.equal(loss, ref_loss) and torch.equal(aux["rows"][0], ref_aux["rows"][0])


def test_aux_outputs_get_no_cotangent_and_the_loss_grads_are_unchanged() -> None:
    g = _check(_aux_fn, has_aux=True)
    ad = ir.stage_autodiff(g, constant=(2, 3), constant_outputs=(1, 2, 3))
    assert ad.ct_slots[0] is not None and ad.ct_slots[1:] == (None, None, None)
    plain = ir.stage_autodiff(g, constant=(2, 3))
    assert all(c is not None for c in plain.ct_slots[:3])  # without it every float output would want one
    assert len(ad.backward.in_slots) < len(plain.backward.in_slots)
