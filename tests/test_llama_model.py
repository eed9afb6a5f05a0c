"""examples/llama_model.py: the Llama-style module computes what it says, and fnpipe pipelines it exactly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.testing import assert_parallel_equivalent
from examples.llama_model import CONFIGS, LlamaConfig, build, example_batch, lm_loss, rope

TINY = CONFIGS["tiny"]


def _reference_logits(model: torch.nn.Module, c: LlamaConfig, tokens: torch.Tensor) -> torch.Tensor:
    """The model written out by hand: float32 RMSNorm, RoPE as complex rotations, k/v repeated per group."""
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return w * (h / h.pow(2).mean(-1, keepdim=True).add(c.eps).sqrt()).to(x.dtype)

    b, t = tokens.shape
    hd = c.head_dim
    freqs = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    turn = torch.polar(torch.ones(t, hd // 2, dtype=torch.float64), torch.outer(torch.arange(t, dtype=torch.float64), freqs))

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [b, h, t, hd], rotate-half pairs (i, i + hd/2)
        z = torch.complex(x[..., : hd // 2], x[..., hd // 2:]) * turn
        return torch.cat((z.real, z.imag), dim=-1)

    x = model.embed.weight[tokens]
    for layer in model.layers.values():
        a = layer.attn
        h = norm(x, layer.attn_norm.weight)
        q = rotate((h @ a.wq.weight.T).view(b, t, c.n_heads, hd).transpose(1, 2))
        k = rotate((h @ a.wk.weight.T).view(b, t, c.n_kv_heads, hd).transpose(1, 2))
        v = (h @ a.wv.weight.T).view(b, t, c.n_kv_heads, hd).transpose(1, 2)
        k, v = (z.repeat_interleave(c.n_heads // c.n_kv_heads, dim=1) for z in (k, v))
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c.d_model)
        x = x + y @ a.wo.weight.T
        h = norm(x, layer.mlp_norm.weight)
        m = layer.mlp
        x = x + (F.silu(h @ m.w1.weight.T) * (h @ m.w3.weight.T)) @ m.w2.weight.T
    return norm(x, model.norm.weight) @ model.head.weight.T


def test_the_module_is_llama_written_out() -> None:
    model = build(TINY, torch.float64)
    tokens, _ = example_batch(TINY, 3)
    torch.testing.assert_close(model(tokens), _reference_logits(model, TINY, tokens), rtol=1e-12, atol=1e-12)
    cos, sin = rope(5, 8, 10000.0, "cpu")
    assert cos.dtype == torch.float32 and cos.shape == (5, 8) and torch.equal(cos[:, :4], cos[:, 4:])


def test_named_sizes_and_bad_head_counts() -> None:
    assert CONFIGS["0.85b"].num_params() == sum(p.numel() for p in build(CONFIGS["0.85b"], device="meta").parameters())
    assert 0.85e9 < CONFIGS["0.85b"].num_params() < 0.86e9
    assert CONFIGS["0.85b"].head_dim == 128 and CONFIGS["0.85b"].n_heads // CONFIGS["0.85b"].n_kv_heads == 4
    with pytest.raises(ValueError, match="n_kv_heads 3"):
        LlamaConfig(n_heads=16, n_kv_heads=3)


def test_rms_norm_computes_in_float32_under_bf16() -> None:
    model = build(TINY, torch.bfloat16)
    x = torch.randn(2, 4, TINY.d_model).to(torch.bfloat16) * 50
    norm = model.layers["0"].attn_norm
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + TINY.eps)).to(torch.bfloat16)
    assert torch.equal(norm(x), want)  # weight is ones: exactly the float32 normalization, rounded once


@pytest.mark.parametrize("schedule,stages", [("1f1b", 2), ("zb-h1", 2), ("zbv", 4), ("interleaved-1f1b", 4)])
def test_fnpipe_pipelines_the_tiny_llama_exactly(schedule: str, stages: int) -> None:
    """Through engine.functionalize, split into stages: loss and every grad leaf equal torch.func.grad's
    on the whole batch, float64."""
    model = build(TINY, torch.float64)
    fn, variables = engine.functionalize(model, loss=lm_loss)
    tokens, targets = example_batch(TINY, 8)
    kw = {"stages_per_rank": 2} if schedule == "interleaved-1f1b" else {}
    result = assert_parallel_equivalent(fn, variables, tokens, targets, schedule=schedule, stages=stages,
                                        microbatches=4, **kw)
    assert result.max_rel_error < 1e-10 and result.leaves == len(list(model.parameters()))
    assert result.plan.num_stages == stages
