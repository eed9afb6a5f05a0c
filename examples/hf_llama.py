"""Train a small Llama, built from a `transformers` config (random init, no download), with fnpipe's zb-h1.

    PYTHONPATH=. mpirun -n 2 python examples/hf_llama.py                       # 2 ranks: CPU gloo, or GPUs (NCCL)
    PYTHONPATH=. torchrun --nproc_per_node 2 --master-port 29513 examples/hf_llama.py --dropout 0.1
    PYTHONPATH=. python examples/hf_llama.py --steps 20                         # one process, same numbers

The model is transformers' own `LlamaForCausalLM`, unmodified: `engine.functionalize` turns it into a
pure `fn(variables, input_ids, labels)` whose loss is the model's `outputs.loss`. With `--dropout p` the
attention dropout is on (train mode) and keyed: `rng=True` adds one batch argument, the per-row keys
`ir.row_keys(seed, batch)` of the step, so every rank draws the masks one process would draw for the same
rows. The data are walks through a fixed random successor table (examples/train_gpt.py's PatternLoader):
the loss starts near ln(vocab) and falls as the model learns the table. `--family` runs the same recipe on
Mistral, Qwen2 or GPT-2.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
import ir  # noqa: E402
from examples.train_gpt import PatternLoader, leaves  # noqa: E402


def build(family: str, *, vocab: int, seq: int, width: int, layers: int, dropout: float) -> torch.nn.Module:
    """A randomly initialised causal LM of `family` from its transformers config."""
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)  # the same weights on every rank
    if family == "gpt2":
        config = T.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=4,
                              resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                              bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(config)
    config_class, model_class = {"llama": (T.LlamaConfig, T.LlamaForCausalLM),
                                 "mistral": (T.MistralConfig, T.MistralForCausalLM),
                                 "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}[family]
    config = config_class(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                          attention_dropout=dropout, use_cache=False, tie_word_embeddings=False)
    return model_class(config)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=("llama", "mistral", "qwen2", "gpt2"), default="llama")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--schedule", default="zb-h1")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0, help="attention dropout in train mode, keyed per row")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=10)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    world = engine.init()
    say = print if world.rank == 0 else (lambda *a, **k: None)
    model = build(args.family, vocab=args.vocab, seq=args.seq, width=args.width, layers=args.layers,
                  dropout=args.dropout).train()
    keyed = args.dropout > 0
    fn, variables = engine.functionalize(model, inputs=("input_ids", "labels"), rng=keyed)
    loader = PatternLoader(types.SimpleNamespace(vocab_size=args.vocab, seq_len=args.seq), args.batch)

    def batch_at(k: int) -> tuple[torch.Tensor, ...]:
        ids = loader.batch_at(k)[0]
        return (ids, ids, ir.row_keys(k, args.batch)) if keyed else (ids, ids)  # labels = ids: HF shifts them

    step = engine.parallelize(fn, variables, *batch_at(0), schedule=args.schedule, microbatches=args.microbatches)
    variables = step.shard(variables)
    mine = [x for x in leaves(variables["params"]) if x is not None]
    opt = torch.optim.AdamW(mine, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    params = sum(p.numel() for p in model.parameters())
    say(f"{type(model).__name__}: {params / 1e6:.2f} M params, {args.layers} layers, width {args.width}, vocab "
        f"{args.vocab}; {world.size} rank(s) on {world.device.type}; ln(vocab) = {math.log(args.vocab):.3f}\n"
        f"{step.plan}", flush=True)
    t0, first = time.perf_counter(), None
    for k in range(args.steps):
        loss, grads = step(variables, *batch_at(k))
        for p, g in zip(leaves(variables["params"]), leaves(grads["params"])):
            if p is not None:
                p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss)
        first = value if first is None else first
        if k % args.log_every == 0 or k == args.steps - 1:
            say(f"step {k + 1:4d}/{args.steps}  loss {value:.4f}", flush=True)
    say(f"done in {time.perf_counter() - t0:.1f} s: loss {first:.4f} -> {value:.4f}", flush=True)


if __name__ == "__main__":
    main()
