"""Per-step overhead of running a traced graph: eager PyTorch vs `ir.compile_graph` vs `ir.interpret`.

    PYTHONPATH=. python benchmarks/ir_overhead.py [--runs 50] [--threads 1]

One pre-norm transformer block (d=256, 4 heads, MLP 4d, seq 64, batch 8, float32, CPU). Rows: the
forward loss, and the loss with its param grads (eager `torch.func.grad_and_value` vs the block's
F, B and W parts from `ir.stage_autodiff` run back to back). Median over `--runs` timed runs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import ir


def block_loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    b, s, d = x.shape
    heads = lambda t: t.reshape(b, s, 4, d // 4).transpose(1, 2)  # noqa: E731
    h = F.layer_norm(x, (d,), p["ln1_w"], p["ln1_b"])
    q, k, v = (heads(h @ p[n]) for n in ("w_q", "w_k", "w_v"))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
    x = x + a @ p["w_o"]
    h = F.layer_norm(x, (d,), p["ln2_w"], p["ln2_b"])
    x = x + F.gelu(h @ p["w_1"] + p["b_1"]) @ p["w_2"]
    return F.mse_loss(x, y)


def make(d: int = 256, seq: int = 64, batch: int = 8) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = lambda *s: torch.randn(s, generator=g) / s[0] ** 0.5  # noqa: E731
    p = {"ln1_w": torch.ones(d), "ln1_b": torch.zeros(d), "w_q": w(d, d), "w_k": w(d, d), "w_v": w(d, d),
         "w_o": w(d, d), "ln2_w": torch.ones(d), "ln2_b": torch.zeros(d), "w_1": w(d, 4 * d),
         "b_1": torch.zeros(4 * d), "w_2": w(4 * d, d)}
    return p, torch.randn(batch, seq, d, generator=g), torch.randn(batch, seq, d, generator=g)


def median_ms(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    """Median milliseconds of each function, timed round-robin so machine noise hits all alike."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def fbw_runner(graph: ir.Graph, flat: list[torch.Tensor], compiled: bool) -> Callable[[], Any]:
    """F, B, W of the whole graph as one stage, as a pipeline stage would run them."""
    ad = ir.stage_autodiff(graph, constant=range(graph.num_params, len(graph.inputs)))
    run = (lambda part, xs: ir.compile_graph(part.graph)(*xs)) if compiled else \
        (lambda part, xs: ir.interpret(part.graph, xs))

    def step() -> Any:
        slots: dict[int, Any] = dict(enumerate(flat))
        slots[ad.ct_slots[0]] = torch.ones(())
        for part in (ad.forward, ad.backward_input, ad.backward_weight):
            slots.update(zip(part.out_slots, run(part, [slots[i] for i in part.in_slots])))
        return [slots[ad.grad_slots[i]] for i in range(graph.num_params)]
    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    p, x, y = make()
    graph = ir.trace(block_loss, p, x, y)
    flat = [*p.values(), x, y]
    fwd = {"eager": lambda: block_loss(p, x, y),
           "compile_graph": lambda: ir.compile_graph(graph)(*flat),
           "interpret": lambda: ir.interpret(graph, flat)}
    grad = {"eager": lambda: torch.func.grad_and_value(block_loss)(p, x, y),
            "compile_graph": fbw_runner(graph, flat, True), "interpret": fbw_runner(graph, flat, False)}
    print(f"transformer block d=256 seq=64 batch=8 f32, torch {torch.__version__}, {args.threads} thread(s), "
          f"median of {args.runs}; {len(graph.eqns)} eqns")
    print(f"{'':<16}{'eager ms':>10}{'compile_graph ms':>18}{'ratio':>7}{'interpret ms':>14}{'ratio':>7}")
    for name, row in (("forward", fwd), ("forward+grads", grad)):
        ms = median_ms(row, args.runs)
        e = ms["eager"]
        print(f"{name:<16}{e:>10.3f}{ms['compile_graph']:>18.3f}{ms['compile_graph'] / e:>7.3f}"
              f"{ms['interpret']:>14.3f}{ms['interpret'] / e:>7.3f}")


if __name__ == "__main__":
    main()
