"""Small models for the multi-process equivalence tests: tied weights and a skip across stages."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def init_params(*, vocab: int = 11, width: int = 8, layers: int = 4, dtype: torch.dtype = torch.float64,
                seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(dtype)  # noqa: E731
    return {
        "embed": rnd(vocab, width),  # tied: also the output head
        "layers": [{"w": rnd(width, width), "b": rnd(width) * 0.1, "ln": torch.ones(width, dtype=dtype)}
                   for _ in range(layers)],
        "skip": rnd(width, width),
    }


def loss_fn(params: dict, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Embedding -> residual MLP layers -> + skip from the first layer's output -> tied head."""
    h = F.embedding(tokens, params["embed"])
    first = None
    for layer in params["layers"]:
        h = h + torch.tanh(F.layer_norm(h, h.shape[-1:], layer["ln"]) @ layer["w"] + layer["b"])
        first = h if first is None else first
    h = h + first @ params["skip"]
    logits = h @ params["embed"].t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(*, size: int = 16, seq: int = 3, vocab: int = 11, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (size, seq), generator=g), torch.randint(0, vocab, (size, seq), generator=g))
