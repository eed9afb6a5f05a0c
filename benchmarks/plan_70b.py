"""Plan a 70 B Llama-style model (built on the meta device) for 1,024 GPUs of 80 GB, trained with bf16
params, fp32 master weights and fp32 Adam moments; print the plan, the planning time and the peak RSS.

    PYTHONPATH=. python benchmarks/plan_70b.py                       # the issue's target: <= 60 s, <= 2 GB RSS
    PYTHONPATH=. python benchmarks/plan_70b.py --layers 8 --world 128 # smaller, for a quick look

(the flags and the runner are benchmarks/plan_scale.py's, with every count "auto" here).

The model (Llama-2-70B's shape): 80 layers, d 8192, 64 heads of 128 with 8 kv heads (GQA), SwiGLU
28672, vocab 32000, RMSNorm, RoPE, causal attention; batch 1,024 sequences of 4,096 tokens (4 M
tokens a step). Nothing is allocated: params and batch are meta tensors, the planner traces under
FakeTensorMode. The recipe lets the planner shard the optimizer state over dp (ZeRO-1) where a
layout fits only so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F



def config(layers: int = 80, d: int = 8192, heads: int = 64, kv_heads: int = 8, ffn: int = 28672,
           vocab: int = 32000) -> dict:
    return dict(layers=layers, d=d, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab)


def params_of(cfg: dict, seq: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    d, hd = cfg["d"], cfg["d"] // cfg["heads"]
    meta = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    layer = lambda: {"attn_norm": meta(d), "wq": meta(d, d), "wk": meta(d, cfg["kv_heads"] * hd),  # noqa: E731
                     "wv": meta(d, cfg["kv_heads"] * hd), "wo": meta(d, d), "mlp_norm": meta(d),
                     "w1": meta(d, cfg["ffn"]), "w3": meta(d, cfg["ffn"]), "w2": meta(cfg["ffn"], d)}
    return {"embed": meta(cfg["vocab"], d), "layers": [layer() for _ in range(cfg["layers"])],
            "norm": meta(d), "head": meta(d, cfg["vocab"]), "rope_cos": meta(seq, hd // 2), "rope_sin": meta(seq, hd // 2)}


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim of x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim / 2).
    The tables are inputs (params the optimizer never moves): a factory op in the loss function would
    bake in a device (CUDA) this CPU build cannot make."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def block(p: dict, h: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, s, d = h.shape
    hd = d // heads
    x = rms_norm(h, p["attn_norm"])
    q = rope((x @ p["wq"]).view(b, s, heads, hd).transpose(1, 2), cos, sin)
    k = rope((x @ p["wk"]).view(b, s, kv_heads, hd).transpose(1, 2), cos, sin)
    v = (x @ p["wv"]).view(b, s, kv_heads, hd).transpose(1, 2)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = h + att.transpose(1, 2).reshape(b, s, d) @ p["wo"]
    x = rms_norm(h, p["mlp_norm"])
    return h + (F.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]


def make_loss(cfg: dict):  # type: ignore[no-untyped-def]
    def loss_fn(params: dict, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, params["embed"])
        for layer in params["layers"]:
            h = block(layer, h, cfg["heads"], cfg["kv_heads"], params["rope_cos"], params["rope_sin"])
        logits = rms_norm(h, params["norm"]) @ params["head"]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss_fn


def main() -> None:
    """`plan_scale.py --target llama70b` with every count "auto" by default (one runner for every plan_*.py)."""
    import plan_scale

    ap = plan_scale.parser(__doc__.splitlines()[0])
    ap.set_defaults(target="llama70b", stages="auto", dp="auto", microbatches="auto", recompute="auto")
    plan_scale.run_target(ap.parse_args())


if __name__ == "__main__":
    main()
