"""Plan transformers' Llama-7B (LlamaForCausalLM, built on the meta device: no weights) for 64 GPUs.

    PYTHONPATH=. python benchmarks/plan_llama7b.py [--world 64] [--batch 512] [--seq 4096] [--device h100]
                                                   [--schedule zb-h1] [--link nvlink]

The model is transformers' own, unmodified, from a Llama-2-7B-shaped config (32 layers, width 4096,
SwiGLU 11008, 32 heads, vocab 32000), in bf16, with its own loss from `labels`; `engine.functionalize`
makes it a pure function and `engine.plan` (one CPU process, fake tensors) picks stages, dp and
microbatches ("auto") for `--world` GPUs of the `--device` profile. Prints the seconds tracing and
planning took, the plan, and the peak RSS.

On a CPU-only torch build the graph is traced for the CPU under the GPU's profile (same ops, attention
one `scaled_dot_product_attention`, same costs): tracing transformers' models for "cuda" there fails in
its mask code (`position_ids[:, :1] - 1` makes a real CUDA scalar: "PyTorch is not linked with support
for cuda devices"), which a CUDA build does not.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.planning.devices import get_device  # noqa: E402

LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, use_cache=False)


def llama_7b(seq: int) -> torch.nn.Module:
    """LlamaForCausalLM of the 7B shape on the meta device, bf16 (no memory is allocated for weights)."""
    import transformers as T

    T.logging.set_verbosity_error()
    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**{**LLAMA_7B, "max_position_embeddings": seq}))
    return model.to(torch.bfloat16).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512, help="sequences per step (the global batch)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--schedule", default="zb-h1")
    ap.add_argument("--link", default="nvlink", help="nvlink, network (100 Gb/s between hosts), pcie")
    args = ap.parse_args()
    start = time.perf_counter()
    model = llama_7b(args.seq)
    fn, variables = engine.functionalize(model, inputs=("input_ids", "labels"))
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    params = sum(p.numel() for p in model.parameters())
    print(f"LlamaForCausalLM {params / 1e9:.2f} B params on meta, built in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    profile = get_device(args.device)
    if not torch.cuda.is_available():  # see the module docstring
        profile = attrs.evolve(profile, kind="cpu")
    plan = engine.plan(fn, variables, ids, ids, world_size=args.world, device=profile, link=args.link,
                       schedule=args.schedule,
                       stages="auto", dp="auto", microbatches="auto")
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"planned for {args.world} x {args.device} in {seconds:.1f} s (peak RSS {rss:.2f} GiB)\n{plan}")


if __name__ == "__main__":
    main()
