"""The example scripts run as a user runs them, and do what they say: examples/train_gpt.py learns."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OMP_NUM_THREADS": "1"}


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_train_gpt_learns_on_two_ranks_under_mpirun(schedule: str) -> None:
    """The tiny GPT on 2 ranks over gloo: the log's final loss is well below the first (the synthetic
    walks are learnable), and every logged loss is finite."""
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "2", "--oversubscribe", sys.executable,
           str(ROOT / "examples/train_gpt.py"), "--tiny", "--steps", "40", "--schedule", schedule, "--log-every", "10"]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"^step +\d+/\d+ .*?loss (\d+\.\d+)", out.stdout, re.M)]
    assert len(losses) == 5, out.stdout[-2000:]
    done = re.search(r"done in [\d.]+ s: loss ([\d.]+) -> ([\d.]+)", out.stdout)
    assert done is not None, out.stdout[-2000:]
    first, last = float(done[1]), float(done[2])
    assert first == pytest.approx(losses[0]) and last < 0.8 * first, (first, last)


@pytest.mark.mpi
@pytest.mark.slow
def test_resnet_wf_learns_with_batchnorm_in_train_mode_on_two_ranks() -> None:
    """examples/resnet_wf.py --tiny: a resnet50x1 of stem width 16 on 32x32 images, BatchNorm in train mode,
    2 pipeline stages under mpirun; the loss falls and evaluation runs on the same plan."""
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "2", "--oversubscribe", sys.executable,
           str(ROOT / "examples/resnet_wf.py"), "--tiny", "--steps", "30", "--stages", "2", "--microbatches", "2"]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 microbatches of 16" in out.stdout, out.stdout[-2000:]
    done = re.search(r"loss ([\d.]+) -> ([\d.]+) \(mean of the last 5 steps\); eval accuracy ([\d.]+)", out.stdout)
    assert done is not None, out.stdout[-2000:]
    first, last, accuracy = (float(x) for x in done.groups())
    assert last < 0.85 * first and 0.0 <= accuracy <= 1.0, (first, last, accuracy)


@pytest.mark.parametrize("family, dropout", [("llama", "0.0"), ("gpt2", "0.1")])
def test_hf_llama_learns_with_zb_h1_on_two_ranks(family: str, dropout: str) -> None:
    """examples/hf_llama.py: a transformers causal LM (keyed dropout for GPT-2) on 2 ranks with zb-h1; the
    loss falls well below its start."""
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "2", "--oversubscribe", sys.executable,
           str(ROOT / "examples/hf_llama.py"), "--family", family, "--dropout", dropout, "--steps", "30"]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"zb-h1(, max_live=\([\d, ]+\))?: 2 stages on 2 ranks", out.stdout), out.stdout[-2000:]
    done = re.search(r"done in [\d.]+ s: loss ([\d.]+) -> ([\d.]+)", out.stdout)
    assert done is not None, out.stdout[-2000:]
    assert float(done[2]) < 0.6 * float(done[1]), done[0]


@pytest.mark.mpi
def test_the_demo_runs_as_make_demo_runs_it() -> None:
    """examples/demo.py under `mpirun -n 2` (what `make demo` runs): every section in order, the programs in
    rank order, each rank's loss and grads equal to torch.func.grad, and the loss falls."""
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "2", "--oversubscribe", sys.executable, str(ROOT / "examples/demo.py")]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    heads = re.findall(r"^== (.+?) ==", out.stdout, re.M)
    order = ["the IR of mlp_loss", "per-equation costs", "plan for a", "the schedule", "rank 0's program",
             "rank 1's program", "measured timeline of one step", "training"]
    assert [o for h in heads for o in order if h.startswith(o)] == order, heads
    errs = re.findall(r"^rank (\d): loss ([\d.]+) vs torch.func.grad ([\d.]+); max rel err .* ([\d.e+-]+)$",
                      out.stdout, re.M)
    assert sorted(r for r, *_ in errs) == ["0", "1"] and all(a == b and float(e) < 1e-10 for _, a, b, e in errs), errs
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\d+\.\d+)", out.stdout, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
