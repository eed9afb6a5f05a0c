"""The torch.distributed.pipelining baseline: the GPT as an nn.Module, split by hand, run by Schedule1F1B/GPipe.

This is PyTorch's documented manual-split recipe (torchtitan, PiPPy examples): build the whole model on
the meta device, delete what other stages own, materialise the rest on this rank's device, wrap it in a
`PipelineStage`, give the schedule the loss function and call `schedule.step(x, target=y, losses=...)`.
The module computes exactly `examples.gpt_model.loss_fn`: each block calls `gpt_model.block` on its own
weights, and the weights are copied from the same parameter tree fnpipe gets, so step-0 losses match.

Only untied heads are supported: a tied head would live on the last stage while the embedding lives on
the first, which PipelineStage cannot share (Megatron all-reduces the two copies' grads by hand).
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from examples import gpt_model
from examples.gpt_model import GPTConfig

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


class Block(nn.Module):
    """One transformer block with nn.Linear / nn.LayerNorm weights, computed by `gpt_model.block`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, f = config.d_model, config.mlp_ratio * config.d_model
        self.head_dim, self.eps = config.head_dim, config.eps
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=config.eps), nn.LayerNorm(d, eps=config.eps)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tree = {name: {"weight": m.weight, "bias": m.bias} for name, m in self.named_children()}
        return gpt_model.block(x, tree, head_dim=self.head_dim, eps=self.eps)


class GPTModule(nn.Module):
    """The GPT of `examples.gpt_model` (untied head) as a module whose parts may be deleted per stage."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.tied:
            raise ValueError("the torch.distributed.pipelining baseline needs an untied head (GPTConfig(tied=False)): "
                             "PipelineStage cannot share the embedding between the first and last stage")
        d = config.d_model
        self.wte: nn.Embedding | None = nn.Embedding(config.vocab_size, d)
        self.wpe: nn.Parameter | None = nn.Parameter(torch.empty(config.seq_len, d))
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(d, eps=config.eps)
        self.head: nn.Linear | None = nn.Linear(d, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # first stage: token ids in
            x = self.wte(x) + self.wpe.narrow(0, 0, x.shape[1])
        for blk in self.blocks.values():
            x = blk(x)
        if self.ln_f is not None:  # last stage: logits out
            x = self.head(self.ln_f(x))
        return x


BARE_LEAVES = {"wte.weight": "wte", "head.weight": "head"}  # modules whose weight is a bare leaf of the tree


def tree_get(params: Any, dotted: str) -> torch.Tensor:
    """`params["blocks"][3]["qkv"]["weight"]` for "blocks.3.qkv.weight" (the module's names are the key paths)."""
    node = params
    for key in BARE_LEAVES.get(dotted, dotted).split("."):
        node = node[int(key)] if isinstance(node, (list, tuple)) else node[key]
    return node


def stage_module(config: GPTConfig, params: Any, blocks: range, *, first: bool, last: bool,
                 device: torch.device, dtype: torch.dtype) -> GPTModule:
    """This rank's part of the model (blocks `blocks`, embeddings if first, head if last), weights from `params`."""
    with torch.device("meta"):
        model = GPTModule(config)
    for i in range(config.n_layers):
        if i not in blocks:
            del model.blocks[str(i)]
    if not first:
        model.wte, model.wpe = None, None
    if not last:
        model.ln_f, model.head = None, None
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = tree_get(params, name)
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"parameter {name}: module shape {tuple(p.shape)}, tree shape {tuple(src.shape)}")
            p.data = src.detach().to(device=device, dtype=dtype).clone()
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same loss as gpt_model.loss_fn after its head: cross-entropy of fp32 logits."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def even_split(n_layers: int, num_stages: int, first_blocks: int | None = None) -> list[range]:
    """Blocks per stage: equal counts (the first stage gets `first_blocks` when given, for 2 stages)."""
    if first_blocks is not None and num_stages == 2:
        return [range(0, first_blocks), range(first_blocks, n_layers)]
    bounds = [round(k * n_layers / num_stages) for k in range(num_stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class TorchPipeline:
    """One rank's torch.distributed.pipelining stage and schedule; `step(tokens, targets)` runs one batch."""

    def __init__(self, config: GPTConfig, params: Any, *, schedule: str, microbatches: int, device: torch.device,
                 dtype: torch.dtype, first_blocks: int | None = None) -> None:
        from torch.distributed import pipelining

        rank, world = dist.get_rank(), dist.get_world_size()
        self.split = even_split(config.n_layers, world, first_blocks)
        self.first, self.last = rank == 0, rank == world - 1
        self.module = stage_module(config, params, self.split[rank], first=self.first, last=self.last,
                                   device=device, dtype=dtype)
        self.stage = pipelining.PipelineStage(self.module, rank, world, device)  # shapes inferred at step 1
        cls = getattr(pipelining, SCHEDULES[schedule])
        self.schedule = cls(self.stage, microbatches, loss_fn=lm_loss)
        self.device = device
        # Training needs no logits back: newer torch can skip keeping and concatenating every microbatch's
        # output on the last stage (3.3 GiB of bf16 logits for the base config); older torch lacks the option.
        self.step_options = {"return_outputs": False} if _accepts(self.schedule.step, "return_outputs") else {}

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One training step (grads accumulate in the module's .grad); the mean loss on the last rank."""
        self.module.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        opts = self.step_options
        if self.first and self.last:
            self.schedule.step(tokens.to(self.device), target=targets.to(self.device), losses=losses, **opts)
        elif self.first:
            self.schedule.step(tokens.to(self.device), **opts)
        elif self.last:
            self.schedule.step(target=targets.to(self.device), losses=losses, **opts)
        else:
            self.schedule.step(**opts)
        return torch.stack(losses).float().mean() if losses else None


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def broadcast_last_loss(loss: torch.Tensor | None, device: torch.device) -> float:
    """The last rank's loss, on every rank (sum of zeros elsewhere)."""
    t = torch.zeros((), dtype=torch.float32, device=device) if loss is None else loss.detach().float().to(device)
    dist.all_reduce(t)
    return float(t)


def run(config: GPTConfig, params: Any, tokens: torch.Tensor, targets: torch.Tensor, *, schedule: str,
        microbatches: int, device: torch.device, dtype: torch.dtype, measure: Callable[..., Any],
        first_blocks: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Build the baseline for `schedule`, then `measure(step_fn)`; returns (measurement, info)."""
    t0 = time.perf_counter()
    pipe = TorchPipeline(config, params, schedule=schedule, microbatches=microbatches, device=device, dtype=dtype,
                         first_blocks=first_blocks)
    build_s = time.perf_counter() - t0
    x, y = tokens.to(device), targets.to(device)
    result = measure(lambda: pipe.step(x, y), loss_of=lambda out: broadcast_last_loss(out, device))
    info = {"blocks_per_rank": [len(r) for r in pipe.split], "build_s": build_s,
            "step_options": pipe.step_options, "torch_schedule": type(pipe.schedule).__name__}
    del pipe
    return result, info
