"""Every python block of the docs runs as written on a CPU: in order as one file, and as its header says."""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, Block, argv, as_one_file, doc_files, python_blocks, ranks
from tests.mpi.jobs import job_env

TIMEOUT_S = 180
DOCS = {str(p.relative_to(ROOT)): python_blocks(p) for p in doc_files() if python_blocks(p)}
HEADED = [b for blocks in DOCS.values() for b in blocks if b.file]


def _env() -> dict[str, str]:
    """fnpipe importable as if installed, one thread a rank, no launcher's variables from this process."""
    env = {k: v for k, v in job_env().items() if not k.startswith(("OMPI_COMM", "PMIX", "PMI_")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "CUDA_VISIBLE_DEVICES": ""}  # CPU only, as on a laptop


def _run(cmd: list[str], cwd: Path) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} still running after {TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    if done.returncode != 0:  # an abort (a negative code) fails here with its output, not the test process
        pytest.fail(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-5000:]}\n{done.stderr[-8000:]}")
    return done.stdout


def test_the_docs_have_runnable_blocks_and_headers_this_test_understands() -> None:
    assert len(DOCS["README.md"]) >= 5, [str(b) for b in DOCS["README.md"]]
    assert {b.file for b in HEADED} >= {"train.py", "test_my_model.py"}
    for doc, blocks in DOCS.items():
        fences = (ROOT / doc).read_text().count("```python")
        assert len(blocks) == fences, f"{doc}: {fences} python fences, {len(blocks)} blocks found"
        for b in blocks:
            first = b.code.splitlines()[0]
            assert b.file or not re.match(r"# \S+\.py: run", first), f"{b}: header not understood: {first}"
            for c in b.commands:
                assert b.file in c.split(), f"{b}: `{c}` does not run {b.file}"
                argv(c)  # a known launcher


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_the_blocks_run_in_order_as_one_file(doc: str, tmp_path: Path) -> None:
    """A reader copies the page's blocks into one file and runs it: on a CPU-only machine, every line
    (tracing for cuda included) works; blocks meant for pytest run in the next test."""
    (tmp_path / "doc.py").write_text(as_one_file(DOCS[doc]))
    out = _run(argv("python doc.py"), tmp_path)
    if doc == "README.md":  # what the blocks print: the usage loop, the IR, a schedule, a plan
        assert re.search(r"^step 20: loss \d\.\d{5}$", out, re.M), out[-3000:]
        assert "= matmul" in out and re.search(r"zb-h1(, max_live=\([\d, ]+\))?: 4 stages on 4 ranks x dp 2 = 8 ranks",
                                                out), out[-3000:]
        assert (tmp_path / "zbh1.png").stat().st_size > 0 and (tmp_path / "zbh1.json").exists()


def _launch_cases() -> list:
    cases = []
    for b in HEADED:
        for c in b.commands:
            marks = [pytest.mark.mpi] if ranks(c) > 1 else []
            cases.append(pytest.param(b, c, marks=marks, id=f"{b.doc}:{b.file}:{c}"))
    return cases


@functools.lru_cache(maxsize=None)
def _output(block: Block, command: str) -> str:
    """What `command` prints, run once per session in a folder holding only the block's file."""
    where = Path(tempfile.mkdtemp(prefix="fnpipe-doc-"))
    (where / block.file).write_text(block.code)
    try:
        return _run(argv(command), where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("block, command", _launch_cases())
def test_each_headed_block_runs_as_its_header_says(block: Block, command: str) -> None:
    out = _output(block, command)
    if block.under_pytest:
        assert re.search(r"\b1 passed\b", out), out[-3000:]
        return
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines, f"`{command}` printed nothing"
    if ranks(command) > 1:  # every rank prints what one process prints (ranks' lines may interleave)
        alone = [ln for ln in _output(block, f"python {block.file}").splitlines() if ln.strip()]
        counts = {ln: out.count(ln) for ln in alone}
        assert counts == {ln: alone.count(ln) * ranks(command) for ln in alone}, f"{command}:\n{out}\nalone:\n" + \
            "\n".join(alone)


def test_the_usage_example_learns() -> None:
    """The README's train.py: the same four losses alone and on 2 ranks (above), and they fall."""
    block = next(b for b in DOCS["README.md"] if b.file == "train.py")
    out = _output(block, "python train.py")
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) == 4 and losses[-1] < 0.9 * losses[0], out


@pytest.mark.mpi
def test_the_usage_example_unseeded_is_refused_on_both_ranks(tmp_path: Path) -> None:
    """Why the README seeds: without it each rank draws its own params and batch, and the first step refuses
    to run on both ranks, naming what differs (instead of silently training on a mix)."""
    block = next(b for b in DOCS["README.md"] if b.file == "train.py")
    assert "torch.manual_seed(0)" in block.code
    (tmp_path / "train.py").write_text(block.code.replace("torch.manual_seed(0)", "torch.seed()"))
    done = subprocess.run(argv("mpirun -n 2 python train.py"), cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode != 0 and "loss" not in done.stdout, done.stdout
    said = re.findall(r"InputError: the ranks' inputs differ: batch leaf 'x' differs between ranks \[0\] and "
                      r"\[1\]; batch leaf 'y' differs between ranks \[0\] and \[1\]", done.stderr)
    assert len(said) == 2, done.stderr[-3000:]
