"""Under mpirun: a model whose stages hand on many small values of mixed dtypes, every schedule, against torch.func.

Each layer emits an aux partial per dtype (a float64 column mean, a float32 scalar) and a bool mask and an
int64 count that the head reads, so every cut carries one activation and a dozen small tensors: the packed
transfers of engine/execution/packing.py, each step after the start-up measurement whose post probe
(engine/execution/post_cost.py) runs the executor's own comm handler on them. Run by tests/engine/test_packing.py as
`mpirun -n 2 python tests/mpi/packing.py`; prints `OK ...` per schedule and rank, `FAIL ...` on a mismatch.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import engine

LAYERS, WIDTH = 6, 8
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}
SCHEDULES = {  # schedule -> (stages on 2 ranks, extra options)
    "gpipe": (2, {}), "1f1b": (2, {}), "zb-h1": (2, {}), "zbv": (4, {}),
    "interleaved-1f1b": (4, {"stages_per_rank": 2}), "looped-bfs": (4, {"stages_per_rank": 2}),
    "interleaved-zb": (4, {"stages_per_rank": 2}), "dualpipev": (4, {}),
}


def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    h, masks, counts, aux = x, [], [], {}
    for i, w in enumerate(p["layers"]):
        h = torch.tanh(h @ w)
        masks.append(h > 0)  # bool: read by the head, so it crosses every later cut
        counts.append((h > 0.5).sum(1))  # int64
        aux[f"mean{i}"] = h.mean(0)  # float64 partial
        aux[f"sq{i}"] = h.float().pow(2).mean()  # float32 partial
    gate = torch.stack(masks).to(h.dtype).mean(0) + torch.stack(counts).to(h.dtype).mean(0, keepdim=True).T * 0.01
    out = (h * gate) @ p["head"]
    return F.mse_loss(out, y), aux


def model(batch: int = 16) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / s[0] ** 0.5  # noqa: E731
    return ({"layers": [r(WIDTH, WIDTH) for _ in range(LAYERS)], "head": r(WIDTH, 1)},
            r(batch, WIDTH), r(batch, 1))


def plan_options(schedule: str) -> dict:
    stages, extra = SCHEDULES[schedule]
    return dict(schedule=schedule, stages=stages, microbatches=4, has_aux=True, **extra)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().cpu().to(want.dtype)
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def errors(result: Any, grads: Any, reference: tuple) -> tuple[float, float]:
    """(max relative error of loss, aux and grads in float64; of the float32 aux leaves), against `reference`."""
    (loss, aux) = result
    ref_grads, (ref_loss, ref_aux) = reference
    f64 = [rel_err(loss, ref_loss)] + [rel_err(g, r) for g, r in zip(pytree.tree_leaves(grads), pytree.tree_leaves(
        ref_grads)) if g is not None]
    f32 = []
    for name, want in ref_aux.items():
        (f32 if want.dtype == torch.float32 else f64).append(rel_err(aux[name], want))
    return max(f64), max(f32)


def main() -> int:
    world = engine.init()
    params, x, y = model()
    reference = torch.func.grad_and_value(loss_fn, has_aux=True)(params, x, y)
    failed = 0
    for schedule in SCHEDULES:
        step = engine.parallelize(loss_fn, params, x, y, compiler="fx", **plan_options(schedule))
        step.profile_programs(x, y)  # the post probe runs the executor's comm handler on the packed transfers
        result, grads = step(step.shard(params), x, y)
        e64, e32 = errors(result, grads, reference)
        ok = e64 <= RTOL[torch.float64] and e32 <= RTOL[torch.float32]
        failed += not ok
        posts = " ".join(f"{p:.3e}" for p in step.posts)
        verdict = "OK" if ok else "FAIL"
        print(f"{verdict} rank {world.rank} {schedule} max rel err {e64:.2e} f32 {e32:.2e} posts {posts}", flush=True)
        step.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
