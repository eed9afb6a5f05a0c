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
    return "-" if not values else "/".join(gib(v) for v in values)


def _ratios(num: Sequence[float] | None, den: Sequence[float] | None) -> str:
    if not num or not den:
        return "-"
    return "/".join(f"{a / b:.2f}" for a, b in zip(num, den))


COLUMNS = (("framework", 7), ("variant", 17), ("schedule", 16), ("s/step", 7), ("x eager", 7), ("x comp", 7),
           ("peak GiB/rank", 13), ("pred s", 7), ("meas/pred", 9), ("prog s", 7), ("m/prog", 6),
           ("pred GiB/rank", 13), ("peak m/p", 9),
           ("1st step s", 10), ("loss0", 8))


def find(rows: Sequence[dict[str, Any]], framework: str, variant: str, schedule: str) -> dict[str, Any] | None:
    """The measured row of (framework, variant prefix, schedule), if any."""
    return next((r for r in rows if r["framework"] == framework and r.get("variant", "").startswith(variant)
                 and r["schedule"] == schedule and "median_s" in r), None)


def baselines(rows: Sequence[dict[str, Any]], r: dict[str, Any]) -> tuple[dict | None, dict | None]:
    """The rows `r` is compared with: PyTorch 1F1B eager and with compiled blocks; for one-device rows, eager
    autograd on one device (and nothing compiled)."""
    if r["schedule"] in ("1-gpu", "1-stage"):
        return find(rows, "torch", "eager-autograd", "1-gpu"), None
    return find(rows, "torch", "eager", "1f1b"), find(rows, "torch", "compiled", "1f1b")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per measured row; `x eager` / `x comp` are throughput relative to the baselines."""
    def cells(r: dict[str, Any]) -> list[str]:
        eager, comp = baselines(rows, r)
        speed = [f"{ref['median_s'] / r['median_s']:.3f}" if ref else "-" for ref in (eager, comp)]
        pred_s, prog_s = r.get("predicted_s"), r.get("program_predicted_s")
        first = r.get("to_first_step_s", r.get("build_s"))
        return [r["framework"], r.get("variant", "-"), r["schedule"], f"{r['median_s']:.3f}", *speed,
                _pair(r.get("peak_bytes")), f"{pred_s:.3f}" if pred_s else "-",
                f"{r['median_s'] / pred_s:.3f}" if pred_s else "-", f"{prog_s:.3f}" if prog_s else "-",
                f"{r['median_s'] / prog_s:.3f}" if prog_s else "-", _pair(r.get("predicted_peak_bytes")),
                _ratios(r.get("peak_bytes"), r.get("predicted_peak_bytes")), f"{first:.1f}" if first else "-",
                f"{r['loss0']:.4f}"]

    def line(values: Sequence[str]) -> str:
        return " ".join(f"{v:<{w}}" if i < 3 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(values, COLUMNS)))

    return "\n".join([line([c for c, _ in COLUMNS]), *(line(cells(r)) for r in rows if r.get("median_s"))])


LEGEND = """\
s/step: median over the measured steps of the slowest rank's step time. x eager / x comp: PyTorch 1F1B's
s/step (eager blocks / each block torch.compile'd) over this row's: throughput relative to it; one-device
rows against eager autograd on one device. peak: torch.cuda.max_memory_allocated per rank. variant: PyTorch
eager or compiled blocks; fnpipe's compiler as asked:as run ("auto:inductor"). pred s: the planner's
step time (plan.predicted_step_time, from op costs); prog s: the step predicted from its stage programs
measured on the device before the first step (step.predicted_step_time: the plan's schedule simulated
with their F/B/W seconds, each rank's host issuing them at their launch times from an idle device and posting
each transfer at its measured cost). pred GiB: each rank's peak replayed from its program, each compute counting
the bytes its program was measured to make (step.memory(); no optimizer is held here); m/p = measured /
predicted. Peaks are this row's: what earlier rows left allocated is taken off. 1st step s: parallelize
(trace, plan, compile, measure the programs) plus the first step (PyTorch: building the stages). loss0:
first step's loss (same weights and batch)."""


def default_out() -> Path:
    base = os.environ.get("OUT")
    return Path(base) / "bench.json" if base else Path("out") / "bench.json"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def targets(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Issue #15's targets, each line the measured ratio, its goal, and met / MISSED."""
    out = []
    eager1 = find(rows, "torch", "eager-autograd", "1-gpu")
    for one in (r for r in rows if r["framework"] == "fnpipe" and r["schedule"] == "1-stage" and "median_s" in r):
        if eager1:
            x = one["median_s"] / eager1["median_s"]
            goal = x <= 1.03 if one["variant"].endswith(":fx") else True
            out.append(f"fnpipe one stage {one['variant']} / eager autograd s/step = {x:.3f}"
                       f"{' (goal <= 1.03)' if one['variant'].endswith(':fx') else ''}: {_verdict(goal)}")
    for pair in (r for r in rows if r["framework"] == "paired"):
        out.append(f"fnpipe one stage fx / eager autograd, {pair['rounds']} paired rounds: median ratio "
                   f"{pair['median_ratio']:.3f} (goal <= 1.03): {_verdict(pair['median_ratio'] <= 1.03)}")
    comp = find(rows, "torch", "compiled", "1f1b")
    piped = [r for r in rows if r["framework"] == "fnpipe" and r.get("ranks", 0) > 1 and "median_s" in r]
    if comp and piped:
        best = min(piped, key=lambda r: r["median_s"])
        goal = 1.10 if best.get("ranks", 2) <= 2 else 1.25
        x = comp["median_s"] / best["median_s"]
        out.append(f"fastest fnpipe ({best['schedule']} {best['variant']}) / compiled torch 1F1B throughput = {x:.3f} "
                   f"(goal >= {goal:.2f}): {_verdict(x >= goal)}")
        default = find(piped, "fnpipe", "auto", "1f1b")
        if default:
            x = comp["median_s"] / default["median_s"]
            out.append(f"fnpipe default (auto) 1f1b / compiled torch 1F1B throughput = {x:.3f} (goal >= 1.00): "
                       f"{_verdict(x >= 1.0)}")
    for r in piped:
        theirs = find(rows, "torch", "compiled", r["schedule"])
        if theirs and r.get("peak_bytes") and theirs.get("peak_bytes"):
            ok = all(a <= b for a, b in zip(r["peak_bytes"], theirs["peak_bytes"]))
            out.append(f"fnpipe {r['schedule']} {r['variant']} peak GiB {_pair(r['peak_bytes'])} vs compiled torch "
                       f"{_pair(theirs['peak_bytes'])} (goal: every rank <=): {_verdict(ok)}")
    for r in (r for r in rows if r.get("predicted_s") and "median_s" in r):
        x = r["median_s"] / r["predicted_s"]
        prog = r["median_s"] / r["program_predicted_s"] if r.get("program_predicted_s") else None
        pred, meas = r.get("predicted_peak_bytes"), r.get("peak_bytes")
        ratios = [m / p for m, p in zip(meas, pred)] if pred and meas else []
        ok = 0.9 <= x <= 1.1 and all(0.9 <= y <= 1.1 for y in ratios)
        bare = r["median_s"] / r["program_device_s"] if r.get("program_device_s") else None
        host = "" if bare is None else f"; no host modelled {bare:.3f}"
        from_programs = "" if prog is None else \
            f" (from the measured programs {prog:.3f}: {_verdict(0.9 <= prog <= 1.1)}{host})"
        out.append(f"fnpipe {r['schedule']} {r['variant']}: measured / predicted s/step {x:.3f}{from_programs}, peak "
                   f"per rank {' / '.join(f'{y:.3f}' for y in ratios) or '-'} (goal 0.90-1.10): {_verdict(ok)}")
    for r in (r for r in rows if r.get("graph_pool_bytes") and r.get("predicted_pool_bytes")):
        rest = [p - q for p, q in zip(r["peak_bytes"], r["graph_pool_bytes"])]
        rest_pred = [p - q for p, q in zip(r["predicted_peak_bytes"], r["predicted_pool_bytes"])]
        out.append(f"fnpipe {r['schedule']} {r['variant']}: CUDA graphs' pool measured / predicted per rank "
                   f"{' / '.join(f'{m / p:.3f}' for m, p in zip(r['graph_pool_bytes'], r['predicted_pool_bytes']))}"
                   f" (GiB {_pair(r['graph_pool_bytes'])} of {_pair(r['predicted_pool_bytes'])}); the rest "
                   f"{' / '.join(f'{m / p:.3f}' for m, p in zip(rest, rest_pred))} (GiB {_pair(rest)} of "
                   f"{_pair(rest_pred)})")
    for r in (r for r in rows if r["framework"] == "fnpipe" and r.get("variant", "").endswith(":inductor")):
        if r.get("to_first_step_s") is not None:
            phases = ", ".join(f"{k} {v:.1f}" for k, v in r.get("setup_s", {}).items() if v >= 0.05)
            out.append(f"fnpipe {r['schedule']} {r['variant']}: parallelize to first step {r['to_first_step_s']:.1f} s "
                       f"(goal <= 30 s on a warm compile cache){f'; rank 0 s: {phases}' if phases else ''}")
    return out


def summary(payload: dict[str, Any]) -> str:
    """The table and the targets of one benchmark JSON, under a line naming its run."""
    head = (f"== {payload.get('model', payload['config'])}, {payload['world_size']} x {payload['device']}, torch "
            f"{payload['torch']}, dp {payload['args'].get('dp', 1)}, batch {payload['batch']} = "
            f"{payload['microbatches']} x {payload['microbatch_size']}")
    problems = [f"{r['framework'].upper()} {r.get('variant', '')} {r['schedule']}: {r['error']}"
                for r in payload["rows"] if "error" in r]
    if payload.get("running"):
        problems.append(f"KILLED while running {payload['running']} (the launch ran out of time or hung there)")
    return "\n".join([head, *problems, format_table(payload["rows"]), *targets(payload["rows"])])


if __name__ == "__main__":  # python benchmarks/bench_report.py out/bench_*.json: the tables again, last
    import sys

    for name in sys.argv[1:]:
        print("\n" + summary(json.loads(Path(name).read_text())))
