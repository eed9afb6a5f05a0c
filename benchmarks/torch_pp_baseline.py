"""The torch.distributed.pipelining baseline: the GPT as nn.Modules, split by hand, run by PyTorch's schedules.

This is PyTorch's documented manual-split recipe (torchtitan, PiPPy examples): build the whole model on
the meta device, delete what a stage does not own, materialise the rest on this rank's device, wrap it in a
`PipelineStage`, give the schedule the loss function and call `schedule.step(x, target=y, losses=...)`.
The modules compute exactly `examples.gpt_model.loss_fn`: each block calls `gpt_model.block` on its own
weights, and the weights are copied from the same parameter tree fnpipe gets, so step-0 losses match.

Schedules (`SCHEDULES`, p ranks per pipeline): "1f1b" and "gpipe" hold one stage per rank; "zb-h1" is
ScheduleInterleavedZeroBubble with one stage per rank; "interleaved-1f1b" and "interleaved-zb" hold v
stages per rank, looped (rank q: stages q, q+p, ...); "zbv" two, in a V (rank q: stages q and 2p-1-q).
The blocks split evenly over the stages; the first stage also holds the embeddings, the last ln_f and
the head.

Data parallel x pipeline (dp > 1) uses fnpipe's rank layout: world rank r is replica r // p at pipeline
position r % p (p = world / dp). Each replica has its own pipeline process group and takes the d-th of dp
contiguous parts of the batch, which the schedule cuts into the microbatches; each position's replicas
share a DP group. Gradients are synced the way PyTorch documents for composing DDP with pipelining: each
stage module is wrapped in DistributedDataParallel over its DP group and the stage runs every backward
but the last microbatch's under `no_sync` (`PipelineStage.backward_maybe_with_nosync`). DDP averages over
the replicas and the schedule divides by the microbatch count (`scale_grads`), so the grads are those of
the mean loss over the whole batch, as fnpipe's are. The zero-bubble schedules compute the backward in
input and weight parts with `torch.autograd.grad`, which never runs DDP's gradient hooks (wrapped in DDP
their grads stay unsynced, silently: relative error 1.2 on the tiny model), so for them the grads are
all-reduced by hand after `schedule.step` instead (`average_grads`). Every stage is given its microbatch
input and output shapes (`stage_io`), which also keeps PipelineStage's shape inference away from DDP.

The same recipe runs the Llama of examples/llama_model.py (`family`: benchmarks.families), and with
`compile_blocks` each transformer block is `torch.compile`d on its own, torchtitan's practice: the
strongest PyTorch baseline.

Only untied heads are supported: a tied head would live on the last stage while the embedding lives on
the first, which PipelineStage cannot share (Megatron all-reduces the two copies' grads by hand).
"""
from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from examples import gpt_model
from examples.gpt_model import GPTConfig

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zb-h1": "ScheduleInterleavedZeroBubble", "interleaved-zb": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble", "looped-bfs": "ScheduleLoopedBFS", "dualpipev": "ScheduleDualPipeV"}
V_SHAPED = {"zbv", "dualpipev"}  # two stages per rank in a V
SINGLE_STAGE = {"1f1b", "gpipe"}  # PipelineScheduleSingle: built on one stage, not a list of them
SPLIT_BACKWARD = {"zb-h1", "interleaved-zb", "zbv", "dualpipev"}  # weight grads by autograd.grad: DDP's hooks never run


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
    """Blocks per stage: equal counts (the first stage gets `first_blocks` when given, for 2 stages). The
    first and last stages may hold none (they have the embeddings and the head); the others may not."""
    if first_blocks is not None and num_stages == 2:
        return [range(0, first_blocks), range(first_blocks, n_layers)]
    bounds = [round(k * n_layers / num_stages) for k in range(num_stages + 1)]
    split = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    if not all(split[1:-1]):
        raise ValueError(f"{n_layers} blocks leave some of the {num_stages} stages empty (use more blocks)")
    return split


def stages_per_rank(schedule: str, v: int) -> int:
    """Stages each rank holds: 1 for 1f1b / gpipe / zb-h1, 2 for zbv and dualpipev, `v` for the looped ones."""
    return {"1f1b": 1, "gpipe": 1, "zb-h1": 1, "zbv": 2, "dualpipev": 2}.get(schedule, v)


def stage_indices(schedule: str, position: int, p: int, v: int) -> list[int]:
    """The stages at pipeline position `position` of `p`: a V for zbv and dualpipev, looped (q, q+p, ...) otherwise."""
    if schedule in V_SHAPED:
        return [position, 2 * p - 1 - position]
    return [position + k * p for k in range(v)]


@dataclass(frozen=True)
class Layout:
    """This rank's place: replica `replica` of `dp`, pipeline position `position` of `p`, and its groups
    (`dp_group` is None without data parallelism)."""

    dp: int
    p: int
    replica: int
    position: int
    pp_group: Any
    dp_group: Any


def make_layout(dp: int) -> Layout:
    """fnpipe's layout of the world: rank r is replica r // p at pipeline position r % p."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp < 1 or world % dp:
        raise ValueError(f"dp={dp} does not divide the world of {world} ranks")
    p = world // dp
    pp_groups, dp_groups = process_groups(dp, world)
    replica, position = divmod(rank, p)
    return Layout(dp, p, replica, position, pp_groups[replica], dp_groups[position] if dp > 1 else None)


@functools.lru_cache(maxsize=None)
def process_groups(dp: int, world: int) -> tuple[list[Any], list[Any]]:
    """One pipeline group per replica (ranks d*p .. d*p+p-1), then one DP group per position (ranks q, q+p,
    ...). `new_group` is collective: every rank makes all of them in this order; cached, so later runs with
    the same dp reuse them."""
    p = world // dp
    pp = [dist.new_group(list(range(d * p, (d + 1) * p))) for d in range(dp)]
    replicas = [dist.new_group(list(range(q, world, p))) for q in range(p)] if dp > 1 else []
    return pp, replicas


def microbatch_size(batch: int, dp: int, microbatches: int) -> int:
    """Rows per microbatch: the batch cut into dp replicas x `microbatches`."""
    if batch % (dp * microbatches):
        raise ValueError(f"batch {batch} does not split into dp={dp} x {microbatches} microbatches")
    return batch // (dp * microbatches)


def replica_batch(batch: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Replica d's part of the batch: the d-th of dp contiguous parts (the schedule cuts it into microbatches)."""
    n = batch.shape[0] // layout.dp
    return batch.narrow(0, layout.replica * n, n)


def average_grads(modules: list[nn.Module], group: Any, dp: int) -> None:
    """The grads' mean over the DP group, for the schedules DDP cannot sync: one flat all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for m in modules:
        for prm in m.parameters():
            if prm.grad is not None:
                by_dtype.setdefault(prm.grad.dtype, []).append(prm.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(dp)
        for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(mean)


def stage_io(config: GPTConfig, stage: int, num_stages: int, microbatch: int, dtype: torch.dtype) -> dict[str, Any]:
    """A stage's microbatch input and output as meta tensors: token ids into the first stage, logits out of
    the last, hidden states between. Given for every stage, they spare PipelineStage its shape inference at
    the first step, which runs the module (DDP included) outside `no_sync` and leaves DDP's reducer expecting
    an extra backward (with GPipe, the second step then fails in DDP's bucket rebuild: "rebuilt parameter
    indices size is not same as original model parameters size")."""
    seq, d = config.seq_len, config.d_model
    x = (torch.empty(microbatch, seq, dtype=torch.long, device="meta") if stage == 0
         else torch.empty(microbatch, seq, d, dtype=dtype, device="meta", requires_grad=True))
    width = config.vocab_size if stage == num_stages - 1 else d
    y = torch.empty(microbatch, seq, width, dtype=dtype, device="meta", requires_grad=True)  # grads flow back
    return {"input_args": x, "output_args": y}


class TorchPipeline:
    """One rank's torch.distributed.pipelining stages and schedule for a batch of `batch` rows;
    `step(tokens, targets)` runs one step on this replica's part of the batch."""

    def __init__(self, config: GPTConfig, params: Any, *, schedule: str, batch: int, microbatches: int,
                 device: torch.device, dtype: torch.dtype, dp: int = 1, v: int = 2,
                 first_blocks: int | None = None, family: Any = None, compile_blocks: bool = False) -> None:
        from torch.distributed import pipelining

        self.layout = lay = make_layout(dp)
        self.v = stages_per_rank(schedule, v)
        n = lay.p * self.v
        self.split = even_split(config.n_layers, n, first_blocks)
        self.placement = [stage_indices(schedule, q, lay.p, self.v) for q in range(lay.p)]
        indices = self.placement[lay.position]
        make = family.stage_module if family is not None else functools.partial(stage_module, config)
        self.modules = [make(params, self.split[i], first=i == 0, last=i == n - 1, device=device, dtype=dtype)
                        for i in indices]
        if compile_blocks:  # torchtitan's practice: each transformer block torch.compile'd on its own
            for mod in self.modules:
                for blk in (family.blocks_of(mod) if family is not None else mod.blocks).values():
                    blk.compile(fullgraph=True)
        self.holds_first, self.holds_last = 0 in indices, n - 1 in indices
        self.ddp = dp > 1 and schedule not in SPLIT_BACKWARD
        mb = microbatch_size(batch, dp, microbatches)
        stages = [pipelining.PipelineStage(self._wrap(mod), i, n, device, group=lay.pp_group,
                                           **stage_io(config, i, n, mb, dtype))
                  for mod, i in zip(self.modules, indices)]
        cls = getattr(pipelining, SCHEDULES[schedule])
        self.schedule = cls(stages[0] if schedule in SINGLE_STAGE else stages, microbatches, loss_fn=lm_loss)
        # Training needs no logits back: newer torch can skip keeping and concatenating every microbatch's
        # output on the last stage (3.3 GiB of bf16 logits for the base config); older torch lacks the option.
        self.step_options = {"return_outputs": False} if _accepts(self.schedule.step, "return_outputs") else {}

    def _wrap(self, module: nn.Module) -> nn.Module:
        """The stage's module, in DDP over this position's DP group when DDP syncs the grads."""
        if not self.ddp:
            return module
        return nn.parallel.DistributedDataParallel(module, process_group=self.layout.dp_group)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One training step (grads accumulate in the modules' .grad, averaged over the replicas); the
        replica's mean loss on the rank holding the last stage, None elsewhere."""
        for m in self.modules:
            m.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.holds_first else ()
        kwargs = {"target": targets, "losses": losses} if self.holds_last else {}
        self.schedule.step(*args, **kwargs, **self.step_options)
        if self.layout.dp > 1 and not self.ddp:
            average_grads(self.modules, self.layout.dp_group, self.layout.dp)
        return torch.stack(losses).float().mean() if losses else None


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def batch_loss(loss: torch.Tensor | None, device: torch.device, dp: int) -> float:
    """The whole batch's mean loss on every rank: the replicas' last-stage losses summed (zeros elsewhere) / dp."""
    t = torch.zeros((), dtype=torch.float32, device=device) if loss is None else loss.detach().float().to(device)
    dist.all_reduce(t)
    return float(t) / dp


def run(config: GPTConfig, params: Any, tokens: torch.Tensor, targets: torch.Tensor, *, schedule: str,
        microbatches: int, device: torch.device, dtype: torch.dtype, measure: Callable[..., Any], dp: int = 1,
        v: int = 2, first_blocks: int | None = None, family: Any = None,
        compile_blocks: bool = False) -> tuple[Any, dict[str, Any]]:
    """Build the baseline for `schedule` (`dp` replicas, `v` stages per rank where the schedule takes it;
    `family`: a benchmarks.families.Family, else the GPT of `config`; `compile_blocks`: each block
    torch.compile'd), then `measure(step_fn)`; returns (measurement, info)."""
    t0 = time.perf_counter()
    pipe = TorchPipeline(config, params, schedule=schedule, batch=tokens.shape[0], microbatches=microbatches,
                         device=device, dtype=dtype, dp=dp, v=v, first_blocks=first_blocks, family=family,
                         compile_blocks=compile_blocks)
    build_s = time.perf_counter() - t0
    x, y = (replica_batch(t, pipe.layout).to(device) for t in (tokens, targets))
    result = measure(lambda: pipe.step(x, y), loss_of=lambda out: batch_loss(out, device, dp))
    info = {"dp": dp, "stages_per_rank": pipe.v, "blocks_per_stage": [len(r) for r in pipe.split],
            "stages_of_position": pipe.placement, "build_s": build_s, "step_options": pipe.step_options,
            "grad_sync": "ddp" if pipe.ddp else "all_reduce" if dp > 1 else None,
            "torch_schedule": type(pipe.schedule).__name__}
    del pipe
    return result, info
