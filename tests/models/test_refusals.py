"""What cannot be a static pipeline is refused at trace with the construct, the file and line, and the way out.

Mixture-of-experts routing that gathers each expert's tokens (transformers' Mixtral and Qwen2-MoE with
their eager experts loop, or one's own layer) makes shapes that depend on the data.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import ir
from engine.testing import assert_parallel_equivalent
from tests.models.zoo import _LM, _ids, _quiet_transformers, case, next_token_loss


def moe_model(kind: str, experts: str) -> nn.Module:
    T = _quiet_transformers()
    torch.manual_seed(0)
    config_class, model_class, extra = {
        "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4)),
        "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                      dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16))}[kind]
    model = model_class(config_class(**_LM, num_experts_per_tok=2, **extra)).double().eval()
    model.set_experts_implementation(experts)
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_transformers_moe_routing_is_refused_with_its_line_and_the_fix(kind: str) -> None:
    fn, variables = engine.functionalize(moe_model(kind, "eager"), inputs=("input_ids", "labels"))
    ids = _ids(0)
    assert torch.isfinite(fn(variables, ids, ids))  # it runs eagerly: only the pipeline cannot
    with pytest.raises(ir.TraceError) as caught:
        ir.trace(fn, variables, ids, ids)
    lines = str(caught.value).splitlines()
    assert lines[0] == f"cannot trace {type(moe_model(kind, 'eager')).__name__}_loss: aten.nonzero.default makes a " \
                       "tensor whose shape depends on the data"
    assert f"models/{kind}/modeling_{kind}.py:" in lines[1] and ".nonzero()" in lines[1]
    assert lines[2].startswith("This is mixture-of-experts routing")
    assert lines[3].startswith("Fix: route with fixed shapes") and 'set_experts_implementation("batched_mm")' in lines[3]


class TopOneMoE(nn.Module):
    """A hand-written switch layer: each token to its best expert, gathered by index (dynamic counts)."""

    def __init__(self, width: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for expert_id, expert in enumerate(self.experts):
            rows = (choice == expert_id).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


def test_own_moe_layer_names_this_file_and_line() -> None:
    fn, variables = engine.functionalize(TopOneMoE().double(), loss=F.mse_loss)
    x = torch.randn(6, 8, dtype=torch.float64)
    with pytest.raises(ir.TraceError) as caught:
        ir.trace(fn, variables, x, x)
    line = inspect.getsourcelines(TopOneMoE.forward)[1] + 4
    text = str(caught.value)
    assert f"test_refusals.py:{line} in forward: rows = (choice == expert_id).nonzero().squeeze(-1)" in text.splitlines()[1]
    assert "mixture-of-experts" in text and "run every expert on every token" in text


def test_mixtral_with_fixed_shape_routing_equals_func_grad() -> None:
    """The way out works: batched_mm experts (top-k on gathered weights) through the pipeline."""
    model = moe_model("mixtral", "batched_mm")
    ids = _ids(1)
    made = case("mixtral", model, ("input_ids",), (ids, ids), loss=next_token_loss, output="logits")
    assert_parallel_equivalent(made, schedule="zb-h1", stages=2, rtol=1e-10, atol=1e-12)
