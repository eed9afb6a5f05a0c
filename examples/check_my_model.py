"""Check that fnpipe pipelines YOUR model correctly: a property test over schedules, cuts and layouts.

    pytest examples/check_my_model.py         # as a test (pytest shrinks a failure to the smallest plan)
    python examples/check_my_model.py         # as a script
    mpirun -n 2 python examples/check_my_model.py   # through the real distributed runtime (gloo/NCCL)
    CHECK_MY_MODEL_EXAMPLES=500 python examples/check_my_model.py   # a longer search (default 60)

Every drawn plan (schedule, stage count, cut points, microbatches, data-parallel degree) must give the
loss and grads `torch.func.grad` gives on the full batch. In one process all ranks run as threads, so a
deadlock is reported, not hung; a mismatch raises `ParallelMismatch` with the first differing leaf, the
plan and every rank's program. In your own suite, `pytest_plugins = ["engine.testing.pytest_plugin"]`
in conftest.py gives the `fnpipe_check` fixture and a summary of the checks run.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402

import engine.testing  # noqa: E402

EXAMPLES = int(os.environ.get("CHECK_MY_MODEL_EXAMPLES", "60"))  # how many plans to draw
BATCH = 8


# ---- your model: a pure loss function of a params pytree and a batch, a mean over the batch ----

def init_params(vocab: int = 11, width: int = 8, layers: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / s[0] ** 0.5  # noqa: E731
    return {"embed": rnd(vocab, width),
            "blocks": [{"w_in": rnd(width, 2 * width), "w_out": rnd(2 * width, width), "ln": torch.ones(width,
                                                                                                   dtype=torch.float64)}
                       for _ in range(layers)]}


def loss_fn(params: dict, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    h = F.embedding(tokens, params["embed"])
    for block in params["blocks"]:
        h = h + F.gelu(F.layer_norm(h, h.shape[-1:], block["ln"]) @ block["w_in"]) @ block["w_out"]
    logits = h @ params["embed"].t()  # tied output head
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


PARAMS = init_params()
_g = torch.Generator().manual_seed(1)
TOKENS, TARGETS = (torch.randint(0, 11, (BATCH, 4), generator=_g) for _ in range(2))


# ---- the property: every plan computes what the function computes ----

@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=engine.testing.in_distributed_job())
@given(engine.testing.plans(batch_size=BATCH))
def test_my_model_is_pipeline_equivalent(spec: engine.testing.PlanSpec) -> None:
    engine.testing.assert_parallel_equivalent(loss_fn, PARAMS, TOKENS, TARGETS, plan=spec)


if __name__ == "__main__":
    test_my_model_is_pipeline_equivalent()
    where = "through the distributed runtime" if engine.testing.in_distributed_job() else "in one process"
    print(engine.testing.format_stats())
    print(f"ok ({where}): every drawn plan matched torch.func.grad")
