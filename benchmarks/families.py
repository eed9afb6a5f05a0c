"""The benchmark's model families: the GPT of examples/gpt_model.py and the Llama of examples/llama_model.py.

A `Family` gives everything a run needs, the same for fnpipe and PyTorch: fnpipe's pure loss function and
its parameter tree (the GPT is written as functions; the Llama is an `nn.Module` taken through
`engine.functionalize`), the module of one PyTorch pipeline stage with the same weights (blocks `blocks`,
the embedding if first, the head if last), the blocks of such a module (what "each block compiled" compiles,
torchtitan's practice), plain eager autograd on one device, and the step's FLOPs.
"""
from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples import gpt_model, llama_model
from examples.gpt_model import GPTConfig
from examples.llama_model import LlamaConfig

GPT_SIZES = {
    "base": GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=16, head_dim=128, tied=False),
    "large": GPTConfig(vocab_size=50304, seq_len=1024, d_model=2560, n_layers=24, head_dim=128, tied=False),
    "tiny": GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, head_dim=16, tied=False),
}
LLAMA_SIZES = {"base": llama_model.CONFIGS["0.85b"], "large": llama_model.CONFIGS["0.85b"],
               "tiny": LlamaConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                   ffn_dim=176)}


@attrs.frozen
class Family:
    """One model family at one size."""

    name: str
    config: Any

    @property
    def n_layers(self) -> int:
        return int(self.config.n_layers)

    def with_layers(self, n: int) -> Family:
        return attrs.evolve(self, config=attrs.evolve(self.config, n_layers=n))

    def describe(self) -> str:
        c = self.config
        if self.name == "gpt":
            return (f"GPT: {c.n_layers} blocks, d={c.d_model}, {c.n_heads} heads, seq {c.seq_len}, vocab {c.vocab_size},"
                    " untied head")
        return (f"Llama: {c.n_layers} blocks, d={c.d_model}, {c.n_heads} heads / {c.n_kv_heads} kv, SwiGLU "
                f"{c.ffn_dim}, seq {c.seq_len}, vocab {c.vocab_size}, untied head")

    def num_params(self) -> int:
        return int(self.config.num_params())

    # -- fnpipe's side: a pure function and its tree ------------------------------------------------------
    def params(self, dtype: torch.dtype, device: Any, seed: int) -> Any:
        """The parameter tree fnpipe gets (the Llama's: `functionalize`'s variables), made on `device`."""
        if self.name == "gpt":
            return gpt_model.init_params(self.config, dtype, device, seed=seed)
        model = llama_model.build(self.config, dtype, device, seed=seed)
        return {"params": _nested((name, p.detach()) for name, p in model.named_parameters()), "buffers": {}}

    def loss_fn(self) -> Callable[..., torch.Tensor]:
        if self.name == "gpt":
            return gpt_model.make_loss_fn(self.config)
        import engine

        with torch.device("meta"):
            shell = llama_model.Llama(self.config)
        fn, _ = engine.functionalize(shell, loss=llama_model.lm_loss)
        return fn

    def batch(self, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        make = gpt_model.example_batch if self.name == "gpt" else llama_model.example_batch
        return make(self.config, batch_size, seed=seed)

    # -- PyTorch's side: modules ----------------------------------------------------------------------------
    def module(self, params: Any, device: Any, dtype: torch.dtype) -> nn.Module:
        """The whole model as one module with `params`' weights (eager autograd on one device)."""
        return self.stage_module(params, range(self.n_layers), first=True, last=True, device=device, dtype=dtype)

    def stage_module(self, params: Any, blocks: range, *, first: bool, last: bool, device: Any,
                     dtype: torch.dtype) -> nn.Module:
        if self.name == "gpt":
            from benchmarks.torch_pp_baseline import stage_module

            return stage_module(self.config, params, blocks, first=first, last=last, device=device, dtype=dtype)
        return _llama_stage(self.config, params, blocks, first=first, last=last, device=device, dtype=dtype)

    def blocks_of(self, module: nn.Module) -> nn.ModuleDict:
        return module.blocks if self.name == "gpt" else module.layers

    def flops(self, batch: int) -> dict[str, float]:
        """FLOPs of one training step (3 x forward): 2 per matmul weight per token, attention 4 s^2 d per
        sequence and layer (halved for the causal mask in `total`)."""
        c = self.config
        if self.name == "gpt":
            from benchmarks.bench_report import model_flops

            return model_flops(c, batch)
        d, s, n, kv = c.d_model, c.seq_len, c.n_layers, c.n_kv_heads * c.head_dim
        matmul_params = n * (2 * d * d + 2 * d * kv + 3 * d * c.ffn_dim) + c.vocab_size * d
        matmul = 6 * matmul_params * batch * s
        attention_full = 3 * 4 * s * s * d * n * batch
        return {"matmul": float(matmul), "attention_full": float(attention_full),
                "attention_causal": attention_full / 2, "total": matmul + attention_full / 2,
                "total_full_attention": float(matmul + attention_full)}


def family(name: str, size: str) -> Family:
    table = {"gpt": GPT_SIZES, "llama": LLAMA_SIZES}
    if name not in table:
        raise ValueError(f"unknown model family {name!r}: choose from {sorted(table)}")
    return Family(name, table[name][size])


def _nested(named: Any) -> dict:
    root: dict = {}
    for name, t in named:
        node = root
        *path, leaf = name.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = t
    return root


def _leaf(params: Any, dotted: str) -> torch.Tensor:
    node = params["params"]
    for key in dotted.split("."):
        node = node[key]
    return node


def _llama_stage(config: LlamaConfig, params: Any, blocks: range, *, first: bool, last: bool, device: Any,
                 dtype: torch.dtype) -> nn.Module:
    """This rank's part of the Llama (blocks `blocks`, the embedding if first, norm and head if last), its
    weights copied from fnpipe's tree (the same names: `layers.3.attn.wq.weight`)."""
    with torch.device("meta"):
        model = llama_model.Llama(config)
    for i in range(config.n_layers):
        if i not in blocks:
            del model.layers[str(i)]
    if not first:
        model.embed = None
    if not last:
        model.norm, model.head = None, None
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = _leaf(params, name).detach().to(device=device, dtype=dtype).clone()
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Both families' loss after the head: token cross-entropy on float32 logits."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
