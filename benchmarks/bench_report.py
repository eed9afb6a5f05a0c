"""The benchmark's arithmetic and output: model FLOPs, each schedule's analytic bound, the table, the JSON."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from examples.gpt_model import GPTConfig

H200_BF16_FLOPS = 700e12  # achievable dense bf16 FLOP/s of one H200 (989 peak x ~0.7)


def model_flops(config: GPTConfig, batch: int) -> dict[str, float]:
    """FLOPs of one training step (forward + backward = 3 x forward) over `batch` sequences.

    Matmuls: 2 FLOPs per weight per token forward (blocks 12 d^2, the head V d; the embedding is a lookup).
    Attention scores and values: 4 s^2 d per sequence and layer forward, halved by the causal mask in
    flash attention (both counts are given; `total` uses the causal one, the work actually done).
    """
    d, s, n = config.d_model, config.seq_len, config.n_layers
    tokens = batch * s
    matmul_params = n * (4 * d * d + 2 * config.mlp_ratio * d * d) + config.vocab_size * d
    matmul = 6 * matmul_params * tokens
    attention_full = 3 * 4 * s * s * d * n * batch
    return {"matmul": float(matmul), "attention_full": float(attention_full),
            "attention_causal": attention_full / 2, "total": matmul + attention_full / 2,
            "total_full_attention": float(matmul + attention_full)}


def ideal_seconds(flops: float, gpus: int, rate: float = H200_BF16_FLOPS) -> float:
    return flops / (rate * gpus)


def bound(schedule: str, p: int, m: int, *, v: int = 2) -> tuple[float, str]:
    """The ideal fraction of p-times speed-up the schedule allows (F = B = W), and its formula;
    `p` is the pipeline depth (ranks per replica), `v` the stages per rank of interleaved-1f1b."""
    if p <= 1:
        return 1.0, "1 (no pipeline)"
    if schedule in ("1f1b", "gpipe"):
        return m / (m + p - 1), "m/(m+p-1)"
    if schedule == "interleaved-1f1b":
        return v * m / (v * m + p - 1), "vm/(vm+p-1)"
    if schedule == "zb-h1":  # idle (p-1)(F+B-W) = (p-1)F against m(F+B+W) = 3mF of work
        return 3 * m / (3 * m + p - 1), "3m/(3m+p-1)"
    if schedule == "zbv":
        return (1.0, "1 (m >= 2p)") if m >= 2 * p else (m / (m + p - 1), "m/(m+p-1) (m < 2p)")
    if schedule == "grad":
        return 1.0, "1 (one GPU)"
    return float("nan"), "?"


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f}"


def _pair(values: Sequence[float] | None) -> str:
    return "-" if not values else " / ".join(gib(v) for v in values)


COLUMNS = (("framework", 9), ("schedule", 9), ("s/step", 7), ("x torch1F1B", 11), ("peak GiB r0/r1", 14),
           ("eff", 6), ("bound", 6), ("bound s", 7), ("pred s", 7), ("pred GiB r0/r1", 14), ("loss0", 8))


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (framework, schedule); `x torch1F1B` is throughput relative to PyTorch's 1F1B."""
    ref = next((r.get("median_s") for r in rows if r["framework"] == "torch" and r["schedule"] == "1f1b"), None)

    def cells(r: dict[str, Any]) -> list[str]:
        speed = f"{ref / r['median_s']:.3f}" if ref and r.get("median_s") else "-"
        pred_s = f"{r['predicted_s']:.3f}" if r.get("predicted_s") else "-"
        bound_s = f"{r['bound_s']:.3f}" if r.get("bound_s") else "-"
        eff = f"{r['efficiency']:.3f}" if r.get("efficiency") else "-"
        return [r["framework"], r["schedule"], f"{r['median_s']:.3f}", speed, _pair(r.get("peak_bytes")), eff,
                f"{r['bound']:.3f}", bound_s, pred_s, _pair(r.get("predicted_peak_bytes")), f"{r['loss0']:.4f}"]

    def line(values: Sequence[str]) -> str:
        return " ".join(f"{v:<{w}}" if i < 2 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(values, COLUMNS)))

    return "\n".join([line([c for c, _ in COLUMNS]), *(line(cells(r)) for r in rows if r.get("median_s"))])


LEGEND = """\
s/step: median over the measured steps of the slowest rank's step time. x torch1F1B: PyTorch 1F1B's
s/step over this row's (throughput relative to it). peak: torch.cuda.max_memory_allocated per rank.
eff: share of the ideal p-fold speed-up reached = one-GPU s/step / (p x s/step), the one-GPU time being
plain torch.func.grad's. bound: the schedule's ideal share (F = B = W); bound s = one-GPU s / (p x bound).
pred: fnpipe's plan: predicted_step_time, and per rank plan.rank_memory minus the Adam state its memory
model adds (this benchmark holds no optimizer). loss0: first step's loss (same weights and batch)."""


def default_out() -> Path:
    base = os.environ.get("OUT")
    return Path(base) / "bench.json" if base else Path("out") / "bench.json"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))


def targets(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's targets, each as measured / reference with the goal."""
    def find(fw: str, sched: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["framework"] == fw and r["schedule"] == sched and "median_s" in r), None)

    out = []
    grad, one = find("torch", "grad"), find("fnpipe", "1-stage")
    if grad and one:
        out.append(f"fnpipe one stage / torch.func.grad = {one['median_s'] / grad['median_s']:.3f} s/s (goal <= 1.03)")
    ref = find("torch", "1f1b")
    piped = [r for r in rows if r["framework"] == "fnpipe" and r.get("ranks", 0) > 1 and "median_s" in r]
    if ref and piped:
        best = min(piped, key=lambda r: r["median_s"])
        out.append(f"fastest fnpipe ({best['schedule']}) throughput / torch 1F1B = {ref['median_s'] / best['median_s']:.3f}"
                   " (goal > 1)")
        same = find("fnpipe", "1f1b")
        if same:
            out.append(f"fnpipe 1f1b throughput / torch 1F1B = {ref['median_s'] / same['median_s']:.3f}")
    for r in rows:
        if r.get("predicted_s"):
            out.append(f"fnpipe {r['schedule']}: measured / predicted s/step = {r['median_s'] / r['predicted_s']:.3f}")
    return out
