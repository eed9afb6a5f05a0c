"""A GPT as pure functions: `init_params(config)` builds the parameter pytree, `loss_fn` is the LM loss.

Pre-norm decoder blocks (GPT-2 layout): causal multi-head attention through
`F.scaled_dot_product_attention(is_causal=True)` and a tanh-GELU MLP, learned position embeddings, a final
layer norm and a head tied to the token embedding (or untied). Weights follow `nn.Linear`'s [out, in]
layout, so `F.linear` runs them as any PyTorch model would. The loss is the mean token cross-entropy,
computed in at least float32 whatever the parameter dtype.

    config = GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=18, head_dim=128)
    params = init_params(config, torch.bfloat16, "cuda")       # "meta": shapes only, for planning
    loss = make_loss_fn(config)(params, tokens, targets)        # tokens, targets: int64 [batch, seq]
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F

Params = dict[str, Any]


@attrs.frozen
class GPTConfig:
    """Sizes of the model; `n_heads = d_model // head_dim`."""

    vocab_size: int = 50304
    seq_len: int = 1024
    d_model: int = 768
    n_layers: int = 12
    head_dim: int = 64
    mlp_ratio: int = 4
    tied: bool = True
    eps: float = 1e-5

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    def num_params(self) -> int:
        d, f = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (f * d + f) + (d * f + d)
        head = 0 if self.tied else self.vocab_size * d
        return self.vocab_size * d + self.seq_len * d + self.n_layers * block + 2 * d + head


def _normal(shape: tuple[int, ...], std: float, dtype: torch.dtype, device: Any, gen: torch.Generator | None) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "meta":
        return t
    return t.normal_(0.0, std, generator=gen)


def _ln(d: int, dtype: torch.dtype, device: Any) -> Params:
    return {"weight": torch.ones(d, dtype=dtype, device=device), "bias": torch.zeros(d, dtype=dtype, device=device)}


def _linear(out: int, inp: int, std: float, dtype: torch.dtype, device: Any, gen: torch.Generator | None) -> Params:
    return {"weight": _normal((out, inp), std, dtype, device, gen), "bias": torch.zeros(out, dtype=dtype, device=device)}


def _block(config: GPTConfig, dtype: torch.dtype, device: Any, gen: torch.Generator | None) -> Params:
    d, f = config.d_model, config.mlp_ratio * config.d_model
    proj_std = 0.02 / math.sqrt(2 * config.n_layers)  # GPT-2: residual projections scaled by depth
    return {
        "ln1": _ln(d, dtype, device),
        "qkv": _linear(3 * d, d, 0.02, dtype, device, gen),
        "proj": _linear(d, d, proj_std, dtype, device, gen),
        "ln2": _ln(d, dtype, device),
        "fc": _linear(f, d, 0.02, dtype, device, gen),
        "out": _linear(d, f, proj_std, dtype, device, gen),
    }


def init_params(config: GPTConfig, dtype: torch.dtype = torch.float32, device: Any = "cpu", *,
                seed: int = 0) -> Params:
    """The parameter pytree; on device "meta" only shapes are made (no memory), for tracing and planning."""
    gen = None if torch.device(device).type == "meta" else torch.Generator(device=device).manual_seed(seed)
    d = config.d_model
    params: Params = {
        "wte": _normal((config.vocab_size, d), 0.02, dtype, device, gen),
        "wpe": _normal((config.seq_len, d), 0.01, dtype, device, gen),
        "blocks": [_block(config, dtype, device, gen) for _ in range(config.n_layers)],
        "ln_f": _ln(d, dtype, device),
    }
    if not config.tied:
        params["head"] = _normal((config.vocab_size, d), 0.02, dtype, device, gen)
    return params


def _layer_norm(x: torch.Tensor, p: Params, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), p["weight"], p["bias"], eps)


def _attention(x: torch.Tensor, p: Params, head_dim: int) -> torch.Tensor:
    b, t, d = x.shape
    qkv = F.linear(x, p["qkv"]["weight"], p["qkv"]["bias"])
    q, k, v = qkv.view(b, t, 3, d // head_dim, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(y.transpose(1, 2).reshape(b, t, d), p["proj"]["weight"], p["proj"]["bias"])


def _mlp(x: torch.Tensor, p: Params) -> torch.Tensor:
    h = F.gelu(F.linear(x, p["fc"]["weight"], p["fc"]["bias"]), approximate="tanh")
    return F.linear(h, p["out"]["weight"], p["out"]["bias"])


def block(x: torch.Tensor, p: Params, *, head_dim: int = 64, eps: float = 1e-5) -> torch.Tensor:
    """One pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""
    x = x + _attention(_layer_norm(x, p["ln1"], eps), p, head_dim)
    return x + _mlp(_layer_norm(x, p["ln2"], eps), p)


def loss_fn(params: Params, tokens: torch.Tensor, targets: torch.Tensor, *, head_dim: int = 64,
            eps: float = 1e-5) -> torch.Tensor:
    """Mean next-token cross-entropy of `targets` given `tokens` (both int64 [batch, seq])."""
    t = tokens.shape[1]
    x = F.embedding(tokens, params["wte"]) + params["wpe"].narrow(0, 0, t)
    for p in params["blocks"]:
        x = block(x, p, head_dim=head_dim, eps=eps)
    x = _layer_norm(x, params["ln_f"], eps)
    logits = F.linear(x, params.get("head", params["wte"]))
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # the softmax of half-precision logits runs in fp32
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def make_loss_fn(config: GPTConfig) -> Callable[..., torch.Tensor]:
    """`loss_fn` with the config's head size and layer-norm epsilon bound."""
    return functools.partial(loss_fn, head_dim=config.head_dim, eps=config.eps)


def example_batch(config: GPTConfig, batch_size: int, device: Any = "cpu", *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their shifted targets, int64 [batch_size, seq_len]."""
    if torch.device(device).type == "meta":
        shape = (batch_size, config.seq_len)
        return torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1), generator=gen).to(device)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
