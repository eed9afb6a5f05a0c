"""engine.optim: functional SGD/AdamW equal torch.optim; accumulation; global-norm clipping over ranks."""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Sequence

import pytest
import torch
from torch.utils import _pytree as pytree

from engine import optim
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.plan import Plan, StagePlan
from engine.testing import max_relative_error
from tests.mpi import models


def on_ranks(steps: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """`fn(step)` on every in-process rank at once (their collectives meet in the hub)."""
    hub = steps[0].transport.hub
    with hub.cv:
        hub.alive, hub.failure = set(range(len(steps))), None
    out: list[Any] = [None] * len(steps)
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            out[r] = fn(steps[r])
            hub.exit(r)
        except BaseException as exc:  # noqa: BLE001 -- re-raised below
            errors.append(exc)
            hub.exit(r, repr(exc))

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(steps))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    return out


def tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if x is not None]


def tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"w": r(4, 3), "layers": [{"b": r(3)}, {"b": r(3), "skip": None}], "s": r(())}


def torch_steps(make, params: dict, grads: Sequence[dict]) -> list[torch.Tensor]:
    leaves = [x.clone() for x in tensors(params)]
    opt = make(leaves)
    for g in grads:
        for x, gx in zip(leaves, tensors(g)):
            x.grad = gx.clone()
        opt.step()
    return leaves


SGD_CASES = [dict(lr=0.1), dict(lr=0.05, momentum=0.9, weight_decay=0.01),
             dict(lr=0.05, momentum=0.8, dampening=0.3), dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1)]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(kw))
def test_sgd_equals_torch_over_steps(kw):
    params, grads = tree(0), [tree(s) for s in (1, 2, 3, 4)]
    ours, state = params, None
    for g in grads:
        ours, state = optim.sgd(ours, g, state, **kw)
    ref = torch_steps(lambda ps: torch.optim.SGD(ps, **kw), params, grads)
    assert ours["layers"][1]["skip"] is None and state["momentum"]["layers"][1]["skip"] is None
    assert max_relative_error(tensors(ours), ref) <= 1e-12


def test_adamw_equals_torch_and_state_is_serialisable(tmp_path):
    params, grads = tree(0), [tree(s) for s in (5, 6, 7, 8, 9)]
    kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    ours, state = params, None
    for g in grads:
        ours, state = optim.adamw(ours, g, state, **kw)
    ref = torch_steps(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), params, grads)
    assert max_relative_error(tensors(ours), ref) <= 1e-12
    assert state["step"] == 5 and json.dumps(state["step"])
    torch.save(state, tmp_path / "s.pt")
    again = torch.load(tmp_path / "s.pt", weights_only=True)
    assert max_relative_error(tensors(again["exp_avg_sq"]), tensors(state["exp_avg_sq"])) == 0


def test_torch_optim_on_local_leaves_equals_functional():
    params, grads = tree(0), [tree(s) for s in (1, 2)]
    sharded = pytree.tree_map(lambda x: None if x is None else x.clone(), params)
    local = optim.local_leaves(sharded)
    opt = torch.optim.AdamW(local, lr=0.01, foreach=False)
    ours, state = params, None
    for g in grads:
        optim.set_grads(sharded, g)
        opt.step()
        ours, state = optim.adamw(ours, g, state, lr=0.01)
    assert max_relative_error(tensors(sharded), tensors(ours)) <= 1e-12


def test_accumulated_half_batches_divided_by_k_equal_the_full_batch_grad():
    params, (x, y) = models.init_params(layers=2), models.batch(size=8)
    full = torch.func.grad(models.loss_fn)(params, x, y)
    acc = None
    for part in range(2):
        acc = optim.accumulate(acc, torch.func.grad(models.loss_fn)(params, x[part::2], y[part::2]))
    assert max_relative_error(optim.scale(acc, 1 / 2), full) <= 1e-12
    with pytest.raises(ValueError, match="does not match params tree"):
        optim.accumulate(acc, {"w": 1})


@pytest.mark.parametrize("max_norm", [1e-2, 1e3])
def test_clip_grad_norm_single_process_equals_torch(max_norm):
    grads = tree(3)
    ours, norm = optim.clip_grad_norm(grads, max_norm)
    ref = _with_grads(tensors(grads))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm).item()
    assert abs(norm.item() - ref_norm) <= 1e-12 * ref_norm
    assert max_relative_error(tensors(ours), [p.grad for p in ref]) <= 1e-12


def _with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


def test_clip_grad_norm_counts_each_leaf_once_over_stages_replicas_and_tied_copies():
    params, batch = models.init_params(layers=4), models.batch(size=8)
    grads_ref = torch.func.grad(models.loss_fn)(params, *batch)
    ref = _with_grads(tensors(grads_ref))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.1).item()
    plan = Plan("1f1b", 2, 2, 2, 2, (14,), (StagePlan(0, 0, 0, 0), StagePlan(1, 0, 0, 1)))  # 2 stages x dp 2
    steps = build_steps(models.loss_fn, params, batch, plan)
    res = run_steps(steps, params, batch)
    assert [0 in s.local_params for s in steps] == [True] * 4  # the tied embedding: 2 stages x 2 replicas
    clipped = on_ranks(steps, lambda s: optim.clip_grad_norm(res.per_rank[s.world.rank][1], 0.1, step=s))
    for rank, (g, norm) in enumerate(clipped):
        assert abs(norm.item() - ref_norm) <= 1e-12 * ref_norm, rank
        for mine, want in zip(pytree.tree_leaves(g), ref):
            assert mine is None or (mine - want.grad).norm() <= 1e-12 * want.grad.norm()


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_clip_grad_norm_under_mpirun_equals_one_process(ranks: int) -> None:
    """The global norm over stages and dp replicas (each leaf counted once) equals torch's on one process."""
    import re
    import sys as _sys

    from tests.mpi.jobs import BIN, job_env, launch

    out = launch([str(BIN / "mpirun"), "-n", str(ranks), "--oversubscribe", "--bind-to", "none", _sys.executable,
                  "tests/mpi/clip_grad_norm.py"], timeout=300, env=job_env())
    configs = 1 if ranks == 2 else 2
    assert "FAIL" not in out, out
    assert len(re.findall(r"^OK rank \d+ ", out, flags=re.M)) == ranks * configs, out
