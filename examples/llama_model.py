"""A Llama-style decoder as a plain `nn.Module` (no transformers needed): RMSNorm in float32, rotary position
embeddings, grouped-query attention, a SwiGLU MLP and an untied head.

It is the second model family of the GPU benchmark: fnpipe takes it through `engine.functionalize`, and
`benchmarks/torch_pp_baseline.py` splits the very same module for `torch.distributed.pipelining` (its parts
may be deleted per stage: a stage without `embed` takes hidden states in, one without `head` gives them
out). Sizes have names (`CONFIGS`): "0.85b" is the benchmark's (issue #15), "tiny" the CPU tests'.

    config = CONFIGS["0.85b"]
    model = build(config, torch.bfloat16, "cuda")                    # deterministic weights (seed)
    fn, variables = engine.functionalize(model, loss=lm_loss)
    step = engine.parallelize(fn, variables, tokens, targets, schedule="zb-h1")

Layout follows Llama's reference code: per block `x + attn(norm(x))` then `x + mlp(norm(x))`; q, k, v and
o projections without biases; RoPE on q and k in the rotate-half form; k and v heads repeated to the query
heads (`n_heads / n_kv_heads` each) before causal scaled-dot-product attention; the MLP is
`w2(silu(w1 x) * w3 x)`. RMSNorm computes in float32 and casts back before its weight, as Llama does, so
bf16 training normalizes in full precision. RoPE's angles are made in the forward from positions (no
buffers), in float32 (both in float64 for a float64 model: the CPU tests compare against torch.func.grad).
"""
from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F


@attrs.frozen
class LlamaConfig:
    """Sizes of the model; `head_dim = d_model // n_heads`; `n_heads` a multiple of `n_kv_heads`."""

    vocab_size: int = 32000
    seq_len: int = 1024
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    n_kv_heads: int = 4
    ffn_dim: int = 5632
    eps: float = 1e-5
    rope_theta: float = 10000.0

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"d_model {self.d_model} must split into n_heads {self.n_heads}, and n_heads into "
                             f"n_kv_heads {self.n_kv_heads} groups")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        block = 2 * d + d * d + 2 * d * kv + d * d + 3 * d * self.ffn_dim
        return 2 * self.vocab_size * d + self.n_layers * block + d


CONFIGS = {
    "0.85b": LlamaConfig(),  # issue #15: 0.853 B parameters
    "tiny": LlamaConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
}


class RMSNorm(nn.Module):
    """x / rms(x) computed in float32, cast back to x's dtype, times the weight."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(wide(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and rotations compute in: float32, or the input's own if wider (float64 tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32  # (promote_types would be traced as an op)


def rope(seq_len: int, head_dim: int, theta: float, device: Any, dtype: torch.dtype = torch.float32
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [seq_len, head_dim] in `dtype` (each frequency twice: rotate-half form)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.to(cos.dtype) * cos + rotated.to(cos.dtype) * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings on q and k."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        self.wq = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k = k[:, :, None].expand(b, self.n_kv, rep, t, self.hd).reshape(b, self.n_heads, t, self.hd)
        v = v[:, :, None].expand(b, self.n_kv, rep, t, self.hd).reshape(b, self.n_heads, t, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.d_model, c.eps), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c.d_model, c.eps), MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]. `embed`, `norm` and `head` may be None and
    `layers` may lose entries (a pipeline stage of the same module): then hidden states come in or go out."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.embed: nn.Embedding | None = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(c.d_model, c.eps)
        self.head: nn.Linear | None = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        cos, sin = rope(x.shape[1], self.config.head_dim, self.config.rope_theta, x.device, wide(x.dtype))
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed on float32 logits (a mean over the batch, as fnpipe's contract asks)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights(model: Llama, *, seed: int = 0) -> Llama:
    """Deterministic weights: normal(0, 0.02) for embeddings and projections (the residual outputs wo and w2
    scaled by 1/sqrt(2 n_layers), as GPT-2 and Llama's reference trainers do), ones for the norms."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    return model


def build(config: LlamaConfig, dtype: torch.dtype = torch.float32, device: Any = "cpu", *, seed: int = 0) -> Llama:
    """The model with `init_weights(seed)`, in `dtype` on `device` ("meta": shapes only, for planning)."""
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return Llama(config).to(dtype)
    return init_weights(Llama(config), seed=seed).to(device=device, dtype=dtype)


def example_batch(config: LlamaConfig, batch_size: int, device: Any = "cpu", *, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their shifted targets, int64 [batch_size, seq_len]."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1), generator=gen).to(device)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
