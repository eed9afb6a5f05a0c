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
    if schedule in ("interleaved-1f1b", "looped-bfs"):
        return v * m / (v * m + p - 1), "vm/(vm+p-1)"
    if schedule == "zb-h1":  # idle (p-1)(F+B-W) = (p-1)F against m(F+B+W) = 3mF of work
        return 3 * m / (3 * m + p - 1), "3m/(3m+p-1)"
    if schedule == "interleaved-zb":  # ZB-H1's idle, shrunk by v stages per rank
        return 3 * v * m / (3 * v * m + p - 1), "3vm/(3vm+p-1)"
    if schedule in ("zbv", "dualpipev"):
        return (1.0, "1 (m >= 2p)") if m >= 2 * p else (m / (m + p - 1), "m/(m+p-1) (m < 2p)")
    if schedule == "grad":
        return 1.0, "1 (one GPU)"
    return float("nan"), "?"


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f}"


def _pair(values: Sequence[float] | None) -> str:
    return "-" if not values else " / ".join(gib(v) for v in values)


COLUMNS = (("framework", 9), ("schedule", 18), ("s/step", 7), ("x torch1F1B", 11), ("peak GiB per rank", 19),
           ("eff", 6), ("bound", 6), ("bound s", 7), ("pred s", 7), ("pred GiB per rank", 19), ("loss0", 8))


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
pred: fnpipe's predictions: the plan's predicted_step_time (its schedule simulation), and per rank the
peak bytes replayed from the rank's program (step.memory(): params, grads, buffers, temporaries; this
benchmark holds no optimizer). loss0: first step's loss (same weights and batch)."""


def default_out() -> Path:
    base = os.environ.get("OUT")
    return Path(base) / "bench.json" if base else Path("out") / "bench.json"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))


def targets(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's targets, each line the measured ratio, its goal, and met / MISSED."""
    def find(fw: str, sched: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["framework"] == fw and r["schedule"] == sched and "median_s" in r), None)

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    out = []
    grad, one = find("torch", "grad"), find("fnpipe", "1-stage")
    if grad and one:
        x = one["median_s"] / grad["median_s"]
        out.append(f"fnpipe one stage / torch.func.grad s/step = {x:.3f} (goal <= 1.03): {verdict(x <= 1.03)}")
    ref = find("torch", "1f1b")
    piped = [r for r in rows if r["framework"] == "fnpipe" and r.get("ranks", 0) > 1 and "median_s" in r]
    if ref and piped:
        best = min(piped, key=lambda r: r["median_s"])
        x = ref["median_s"] / best["median_s"]
        out.append(f"fastest fnpipe ({best['schedule']}) throughput / torch 1F1B = {x:.3f} (goal >= 1.10): "
                   f"{verdict(x >= 1.10)}")
        same = find("fnpipe", "1f1b")
        if same:
            x = ref["median_s"] / same["median_s"]
            out.append(f"fnpipe 1f1b throughput / torch 1F1B = {x:.3f} (goal >= 1.00): {verdict(x >= 1.0)}")
    for r in piped:
        mine = r["schedule"].split("+")[0]
        theirs = find("torch", mine)
        if theirs and r.get("peak_bytes") and theirs.get("peak_bytes"):
            ok = all(a <= b for a, b in zip(r["peak_bytes"], theirs["peak_bytes"]))
            out.append(f"fnpipe {r['schedule']} peak GiB {_pair(r['peak_bytes'])} vs torch {_pair(theirs['peak_bytes'])}"
                       f" (goal: every rank <=): {verdict(ok)}")
    for r in (r for r in rows if r.get("predicted_s") and "median_s" in r):
        x = r["median_s"] / r["predicted_s"]
        out.append(f"fnpipe {r['schedule']}: measured / predicted s/step = {x:.3f} (goal 0.90-1.10): "
                   f"{verdict(0.9 <= x <= 1.1)}")
        pred, meas = r.get("predicted_peak_bytes"), r.get("peak_bytes")
        if pred and meas:
            ratios = [m / p for m, p in zip(meas, pred)]
            out.append(f"fnpipe {r['schedule']}: measured / predicted peak per rank = "
                       f"{' / '.join(f'{x:.3f}' for x in ratios)} (goal 0.90-1.10): "
                       f"{verdict(all(0.9 <= x <= 1.1 for x in ratios))}")
    return out


def summary(payload: dict[str, Any]) -> str:
    """The table and the targets of one benchmark JSON, under a line naming its run."""
    head = (f"== {payload['config']} GPT, {payload['world_size']} x {payload['device']}, torch {payload['torch']}, "
            f"dp {payload['args'].get('dp', 1)}, batch {payload['batch']} = {payload['microbatches']} x "
            f"{payload['microbatch_size']}")
    return "\n".join([head, format_table(payload["rows"]), *targets(payload["rows"])])


if __name__ == "__main__":  # python benchmarks/bench_report.py out/bench_*.json: the tables again, last
    import sys

    for name in sys.argv[1:]:
        print("\n" + summary(json.loads(Path(name).read_text())))
