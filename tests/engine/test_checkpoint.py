"""engine.checkpoint: save by leaf name on one plan, load on another; interrupted saves never load; damaged
or hostile checkpoints are refused with CheckpointError on every rank."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
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
from tests.mpi.jobs import BIN, job_env, launch

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


def outcomes(steps, fn):
    """`fn(step)` on every in-process rank; each rank's result or CheckpointError (on_ranks raises only one)."""
    def catch(step):
        try:
            return fn(step)
        except CheckpointError as exc:
            return exc
    return on_ranks(steps, catch)


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


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_disk_full_on_one_rank_raises_on_every_rank_and_leaves_no_manifest(trained, monkeypatch, bad_rank):
    path, params, per_rank = trained
    root = path.parent
    steps = build_steps(models.loss_fn, params, models.batch(size=8), make_plan(2, 1, (14,)))
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        if ("layers.3.w" in obj["params"]) == (bad_rank == 1):  # only rank 1's file holds layers.3.w
            f.write(b"half a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    target = root / f"full{bad_rank}"
    raised = outcomes(steps, lambda s: checkpoint.save(target, s, s.shard(params), iteration=2))
    assert [type(e) for e in raised] == [CheckpointError, CheckpointError]
    for exc in raised:
        assert str(exc) == (f"saving the tensors of {target} failed (rank {bad_rank}: OSError: [Errno 28] No space "
                            "left on device [ENOSPC]); it has no manifest and will not be loaded; other checkpoint "
                            "directories are untouched; fix the cause (a full disk: free space) and save again")
    assert sorted(os.listdir(target)) == [f"rank{1 - bad_rank}.pt"]  # no manifest, no temp debris
    with pytest.raises(CheckpointError, match="has no manifest.json.*interrupted"):
        checkpoint.load(target, None, params)
    assert checkpoint.latest(root) == path
    assert_same(checkpoint.load(path, None, params)[0], merged(per_rank, 0))


def test_a_save_that_cannot_start_raises_on_every_rank(trained, tmp_path):
    params = trained[1]
    steps = build_steps(models.loss_fn, params, models.batch(size=8), make_plan(2, 1, (14,)))
    (tmp_path / "taken").write_text("a file, not a directory")
    taken = tmp_path / "taken"
    raised = outcomes(steps, lambda s: checkpoint.save(taken, s, s.shard(params)))
    assert [str(e) for e in raised] == [f"preparing {taken} failed (ranks 0, 1: FileExistsError: [Errno 17] File "
                                        f"exists: '{taken}' [EEXIST]); nothing was written; fix the cause and save "
                                        "again"] * 2


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


# -- checkpoints verify themselves ------------------------------------------------------------------
FIX = "restore the file from a copy, or load an earlier checkpoint"
MANIFEST_FIX = "restore manifest.json from a copy, or load an earlier checkpoint"


def copy_of(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained[0], tmp_path / "ckpt"))


def edit_manifest(path: Path, edit) -> None:
    man = json.loads((path / "manifest.json").read_text())
    edit(man)
    (path / "manifest.json").write_text(json.dumps(man))


def sha(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def refused(path: Path, params, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, None, params)
    assert str(info.value) == f"loading the checkpoint {path} failed ({message})"


def test_round_trip_is_bit_identical_and_the_manifest_has_each_shards_digest(tmp_path):
    weird = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, -1.5])
    params = {"w": weird, "h": weird.half(), "b": torch.randn(3, 4).bfloat16(), "i": torch.arange(5)}
    checkpoint.save(tmp_path / "c", None, params)
    man = json.loads((tmp_path / "c" / "manifest.json").read_text())
    file = tmp_path / "c" / "rank0.pt"
    assert man["format"] == "fnpipe-checkpoint/2"
    assert man["files"] == [{"path": "rank0.pt", "sha256": sha(file), "bytes": file.stat().st_size}]
    loaded, _ = checkpoint.load(tmp_path / "c", None, params)
    for name, x in params.items():
        y = loaded[name]
        assert y.dtype == x.dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8)), name


def test_a_flipped_bit_is_caught_before_it_loads(tmp_path):
    params = {"w": torch.arange(64.0).reshape(8, 8)}
    path = checkpoint.save(tmp_path / "c", None, params)
    file, before = path / "rank0.pt", sha(path / "rank0.pt")
    data = bytearray(file.read_bytes())
    data[bytes(data).find(params["w"].numpy().tobytes()) + 4 * 9] ^= 0x01  # lowest mantissa bit of w[1, 1]
    file.write_bytes(bytes(data))
    silently = torch.load(file, weights_only=True)["params"]["w"]  # what load returned before digests
    assert (silently != params["w"]).sum() == 1 and silently[1, 1] != 9.0
    refused(path, params, f"checkpoint shard {file} is damaged: expected sha256 {before}, found {sha(file)} "
                          f"({len(data)} bytes, as expected); {FIX}")


def test_a_truncated_shard_is_caught_by_its_size(tmp_path):
    params = {"w": torch.arange(64.0).reshape(8, 8)}
    path = checkpoint.save(tmp_path / "c", None, params)
    file = path / "rank0.pt"
    size = file.stat().st_size
    file.write_bytes(file.read_bytes()[:300])
    refused(path, params, f"checkpoint shard {file} is damaged: expected {size} bytes, found 300 (truncated or "
                          f"replaced); {FIX}")


def test_swapped_shards_name_whose_bytes_they_are(trained, tmp_path):
    path, params = copy_of(trained, tmp_path), trained[1]
    size0 = (path / "rank0.pt").stat().st_size
    os.replace(path / "rank0.pt", path / "tmp")
    os.replace(path / "rank1.pt", path / "rank0.pt")
    os.replace(path / "tmp", path / "rank1.pt")
    found = (path / "rank0.pt").stat().st_size
    refused(path, params, f"checkpoint shard {path / 'rank0.pt'} is damaged: expected {size0} bytes, found {found} "
                          f"({'truncated' if found < size0 else 'grown'} or replaced); these are the bytes of "
                          f"rank1.pt (files swapped or copied over?); {FIX}")


def test_a_damaged_shard_on_one_rank_raises_on_every_rank(trained, tmp_path):
    path, params = copy_of(trained, tmp_path), trained[1]
    file = path / "rank1.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))
    steps = build_steps(models.loss_fn, params, models.batch(size=8), make_plan(2, 1, (14,)))
    raised = outcomes(steps, lambda s: checkpoint.load(path, s, s.shard(params)))
    assert [type(e) for e in raised] == [CheckpointError, CheckpointError]  # rank 0's own shard is fine
    expected = json.loads((path / "manifest.json").read_text())["files"][1]["sha256"]
    for exc in raised:
        assert str(exc) == (f"loading the checkpoint {path} failed (rank 1: checkpoint shard {file} is damaged: "
                            f"expected sha256 {expected}, found {sha(file)} ({len(data)} bytes, as expected); {FIX})")


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "format-1 dotdot"])
def test_shard_paths_stay_inside_the_checkpoint_directory(trained, tmp_path, how):
    path, params = copy_of(trained, tmp_path), trained[1]
    outside = Path(shutil.copy(path / "rank1.pt", tmp_path / "outside.pt"))  # its digest matches: only the path is bad
    link_fix = "copy the file itself in place of the link, or load an earlier checkpoint"
    entry, why, fix = {"dotdot": ("../outside.pt", "contains '..'", MANIFEST_FIX),
                       "absolute": (str(outside), "is an absolute path", MANIFEST_FIX),
                       "symlink": ("rank1.pt", f"resolves to {outside}, outside {path.resolve()} through a symbolic "
                                               "link", link_fix),
                       "format-1 dotdot": ("../outside.pt", "contains '..'", MANIFEST_FIX)}[how]
    if how == "symlink":
        (path / "rank1.pt").unlink()
        (path / "rank1.pt").symlink_to(outside)
    elif how == "format-1 dotdot":
        edit_manifest(path, lambda m: m.update(format="fnpipe-checkpoint/1", files=["rank0.pt", entry]))
    else:
        edit_manifest(path, lambda m: m["files"][1].update(path=entry))
    refused(path, params, f"{path}/manifest.json names {entry!r} (files[1]), which {why}: refused, a checkpoint reads "
                          f"only files inside its own directory; {fix}")


NEWER = ("written by a newer fnpipe (or edited by hand): upgrade fnpipe, or export it there (engine.checkpoint.export) "
         "and torch.load the exported file")


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(format="fnpipe-checkpoint/3"),
     "{file} has format 'fnpipe-checkpoint/3' (from fnpipe '{version}'); this fnpipe ({version}) reads "
     "'fnpipe-checkpoint/2' and 'fnpipe-checkpoint/1': " + NEWER),
    (lambda m: m.update(format="safetensors"),
     "{file} has format 'safetensors'; this fnpipe ({version}) reads 'fnpipe-checkpoint/2' and 'fnpipe-checkpoint/1': "
     "it is not an fnpipe checkpoint manifest, or the manifest is damaged: " + MANIFEST_FIX),
    (lambda m: m.update(compression="zstd"),
     "{file}: the manifest has unknown field(s) ['compression'] (format 'fnpipe-checkpoint/2' has ['format', "
     "'fnpipe_version', 'iteration', 'meta', 'world_size', 'files', 'plan', 'params', 'opt_state']); " + NEWER),
    (lambda m: m["files"][0].update(codec="zstd"),
     "{file}: files[0] has unknown field(s) ['codec'] (format 'fnpipe-checkpoint/2' has ['path', 'sha256', "
     "'bytes']); " + NEWER),
    (lambda m: m["files"][1].pop("sha256"), "{file}: files[1] lacks field(s) ['sha256']; the manifest is damaged: "
     + MANIFEST_FIX),
    (lambda m: m["params"]["leaves"][0].update(file=7), "{file}: params.leaves[0].file is 7, not a shard of "
     "files[0..1]; the manifest is damaged: " + MANIFEST_FIX),
], ids=["newer-format", "other-format", "unknown-field", "unknown-shard-field", "missing-field", "bad-file-index"])
def test_manifests_this_fnpipe_does_not_know_are_refused(trained, tmp_path, edit, message):
    from engine.version import fnpipe_version

    path, params = copy_of(trained, tmp_path), trained[1]
    edit_manifest(path, edit)
    refused(path, params, message.format(file=path / "manifest.json", version=fnpipe_version()))
    assert checkpoint.latest(tmp_path) is None  # and latest skips it


def test_format_1_manifests_load_unverified_with_a_warning(trained, tmp_path):
    path, params, per_rank = copy_of(trained, tmp_path), trained[1], trained[2]
    edit_manifest(path, lambda m: m.update(format="fnpipe-checkpoint/1", files=[f["path"] for f in m["files"]]))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("engine.checkpoint").addHandler(handler)
    try:
        p, state = checkpoint.load(path, None, params)
    finally:
        logging.getLogger("engine.checkpoint").removeHandler(handler)
    assert_same(p, merged(per_rank, 0))
    assert_same(state, merged(per_rank, 1))
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("WARNING", (f"{path / 'manifest.json'} is format fnpipe-checkpoint/1, without shard digests: its shards "
                     "load unverified; save it again with this fnpipe to have them checked"))]


@pytest.mark.mpi
def test_a_damaged_shard_raises_on_both_ranks_under_mpirun(tmp_path):
    out = launch([str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                  "tests/mpi/checkpoint_faults.py", str(tmp_path)], timeout=240, env=job_env())
    assert sorted(re.findall(r"^rank (\d) clean load identical$", out, flags=re.M)) == ["0", "1"], out
    file = tmp_path / "000001" / "rank1.pt"
    raised = dict(re.findall(r"^rank (\d) CheckpointError: (.*)$", out, flags=re.M))
    assert sorted(raised) == ["0", "1"], out
    expected = json.loads((tmp_path / "000001" / "manifest.json").read_text())["files"][1]["sha256"]
    for message in raised.values():
        assert message == (f"loading the checkpoint {tmp_path / '000001'} failed (rank 1: checkpoint shard {file} is "
                           f"damaged: expected sha256 {expected}, found {sha(file)} ({file.stat().st_size} bytes, as "
                           f"expected); {FIX})")
