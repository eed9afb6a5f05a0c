"""engine.checkpoint: save by leaf name on one plan, load on another; interrupted saves never load."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from engine import checkpoint, optim
from engine.checkpoint import CheckpointError
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.plan import Plan, StagePlan
from test_optim import on_ranks
from tests.mpi import models

REPO = Path(__file__).resolve().parents[2]


def make_plan(stages: int, dp: int, cuts: tuple[int, ...]) -> Plan:
    return Plan("1f1b", stages, stages, dp, 2, cuts, tuple(StagePlan(k, 0, 0, k) for k in range(stages)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One AdamW step on 2 stages (ranks 0, 1), saved; returns the dir and every rank's saved trees."""
    params, batch = models.init_params(layers=4), models.batch(size=8)
    steps = build_steps(models.loss_fn, params, batch, make_plan(2, 1, (14,)))
    res = run_steps(steps, params, batch)
    path = tmp_path_factory.mktemp("ckpt") / "000001"

    def train_and_save(step):
        new, state = optim.adamw(step.shard(params), res.per_rank[step.world.rank][1], lr=0.1)
        checkpoint.save(path, step, new, state, iteration=1, meta={"lr": 0.1})
        return new, state

    return path, params, on_ranks(steps, train_and_save)


def merged(per_rank, part: int):
    """Full tree from the ranks' trees (each leaf from a rank that holds it)."""
    trees = [pytree.tree_flatten(t[part], is_leaf=lambda x: x is None) for t in per_rank]
    leaves = [next((ls[i] for ls, _ in trees if ls[i] is not None), None) for i in range(len(trees[0][0]))]
    return pytree.tree_unflatten(leaves, trees[0][1])


def assert_same(actual, expected) -> None:
    a, a_spec = pytree.tree_flatten(actual, is_leaf=lambda x: x is None)
    e, e_spec = pytree.tree_flatten(expected, is_leaf=lambda x: x is None)
    assert a_spec == e_spec
    for x, y in zip(a, e):
        assert (x is None and y is None) or (isinstance(x, torch.Tensor) and torch.equal(x, y)) or x == y


def test_manifest_names_each_leaf_once_with_its_holders(trained):
    path, _, _ = trained
    man = json.loads((path / "manifest.json").read_text())
    leaves = {e["name"]: e for e in man["params"]["leaves"]}
    assert leaves["embed"]["ranks"] == [0, 1] and leaves["embed"]["file"] == 0  # tied: on both, written once
    assert leaves["layers.3.w"] == {"name": "layers.3.w", "shape": [8, 8], "dtype": "torch.float64", "ranks": [1],
                                    "file": 1}
    assert man["iteration"] == 1 and man["meta"] == {"lr": 0.1} and man["plan"]["num_stages"] == 2
    assert {"name": "step", "value": 1} in man["opt_state"]["leaves"]
    saved = torch.load(path / "rank1.pt", weights_only=True)
    assert "embed" not in saved["params"] and "exp_avg.layers.3.w" in saved["opt_state"]


@pytest.mark.parametrize("stages,dp,cuts", [(1, 2, ()), (3, 1, (9, 19))], ids=["dp2", "3stages"])
def test_load_onto_another_plan_by_leaf_name(trained, stages, dp, cuts):
    path, params, per_rank = trained
    full_params, full_state = merged(per_rank, 0), merged(per_rank, 1)
    steps = build_steps(models.loss_fn, params, models.batch(size=8), make_plan(stages, dp, cuts))
    loaded = on_ranks(steps, lambda s: checkpoint.load(path, s, s.shard(params)))
    for step, (p, state) in zip(steps, loaded):
        local = set(step.local_params)
        keep = lambda tree: pytree.tree_unflatten(  # noqa: E731 -- the full tree masked to this rank
            [x if i in local else None for i, x in enumerate(pytree.tree_leaves(tree, is_leaf=lambda x: x is None))],
            pytree.tree_structure(tree, is_leaf=lambda x: x is None))
        assert_same(p, keep(full_params))
        assert_same(state, {"step": 1, "exp_avg": keep(full_state["exp_avg"]),
                            "exp_avg_sq": keep(full_state["exp_avg_sq"])})


def test_load_alone_and_export_give_the_full_trees(trained, tmp_path):
    path, params, per_rank = trained
    p, state = checkpoint.load(path, None, params)
    assert_same(p, merged(per_rank, 0))
    assert_same(state, merged(per_rank, 1))
    out = checkpoint.export(path, None, tmp_path / "full.pt")
    full = torch.load(out, weights_only=True)
    assert_same(full["params"], p)
    assert_same(full["opt_state"], state)
    assert full["iteration"] == 1


def test_mismatched_template_names_the_leaf(trained):
    path, params, _ = trained
    wrong = pytree.tree_map(lambda x: x, params)
    wrong["skip"] = torch.zeros(8, 9, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"leaf 'skip': checkpoint has torch.float64\[8, 8\], the model wants "
                                              r"torch.float64\[8, 9\]"):
        checkpoint.load(path, None, wrong)
    wrong = {**params, "extra": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"missing \['extra'\], unexpected \[\]"):
        checkpoint.load(path, None, wrong)
    half = pytree.tree_map(lambda x: x.float(), params)
    with pytest.raises(CheckpointError, match="leaf 'embed'.*wants torch.float32"):
        checkpoint.load(path, None, half)


def test_dtypes_and_plain_values_round_trip(tmp_path):
    params = {"a": torch.randn(3), "b": torch.randn(2, 2).bfloat16(), "n": torch.arange(4)}
    state = {"step": 7, "lr": 0.5, "name": "x", "skipped": None, "m": {"a": torch.ones(3), "b": None, "n": None}}
    checkpoint.save(tmp_path / "c", None, params, state)
    p, s = checkpoint.load(tmp_path / "c", None, params)
    assert_same(p, params)
    assert_same(s, state)


def test_failed_save_leaves_the_previous_checkpoint_the_latest(trained, monkeypatch):
    path, params, per_rank = trained
    root = path.parent
    steps = build_steps(models.loss_fn, params, models.batch(size=8), make_plan(2, 1, (14,)))
    real_save = torch.save

    def flaky_save(obj, f, *a, **kw):
        if "layers.3.w" in obj["params"]:  # rank 1's file
            f.write(b"half a file")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", flaky_save)
    with pytest.raises(CheckpointError, match="rank 1: OSError.*No space left.*other checkpoint directories"):
        on_ranks(steps, lambda s: checkpoint.save(root / "000002", s, s.shard(params), iteration=2))
    assert sorted(os.listdir(root / "000002")) == ["rank0.pt"]  # no manifest, no temp debris
    with pytest.raises(CheckpointError, match="has no manifest.json.*interrupted"):
        checkpoint.load(root / "000002", None, params)
    assert checkpoint.latest(root) == path
    assert_same(checkpoint.load(path, None, params)[0], merged(per_rank, 0))


def test_process_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    script = textwrap.dedent(f"""
        import os, torch
        from engine import checkpoint
        params = {{"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}}
        checkpoint.save("{tmp_path}/1", None, params, iteration=1)
        real = os.replace
        def replace_then_die(src, dst):
            real(src, dst)
            if str(dst).endswith("2/rank0.pt"):
                os._exit(9)          # killed after the tensors, before the manifest
        os.replace = replace_then_die
        checkpoint.save("{tmp_path}/2", None, {{"w": params["w"] + 1, "b": params["b"]}}, iteration=2)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    assert (tmp_path / "2" / "rank0.pt").exists() and not checkpoint.is_complete(tmp_path / "2")
    assert checkpoint.latest(tmp_path) == tmp_path / "1"
    template = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    params, state = checkpoint.load(checkpoint.latest(tmp_path), None, template)
    assert torch.equal(params["w"], torch.arange(6.0).reshape(2, 3)) and state is None


@pytest.mark.slow
def test_resume_example_from_two_stages_on_two_ranks_to_one_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    example = [str(REPO / "examples/resume.py"), "--ckpt", str(tmp_path), "--steps", "5", "--stop-at", "2"]
    first = subprocess.run([str(REPO / ".venv/bin/mpirun"), "-n", "2", "--oversubscribe", sys.executable, *example,
                            "--phase", "first"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "checkpoint at step 2" in first.stdout and checkpoint.is_complete(tmp_path / "000002")
    again = subprocess.run([sys.executable, *example, "--phase", "resume"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    found = re.search(r"final loss: uninterrupted ([-+.\de]+), resumed ([-+.\de]+);", again.stdout)
    uninterrupted, resumed = float(found[1]), float(found[2])
    assert abs(uninterrupted - resumed) <= 1e-9 * abs(uninterrupted)
    assert "{'schedule': '1f1b', 'stages': 2} x 2 ranks) on {'schedule': '1f1b', 'stages': 1} x 1 ranks" in again.stdout
