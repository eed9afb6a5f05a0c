"""README's install section in a fresh venv: `pip install .` and `-e .`, then import and train elsewhere."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, python_blocks

pytestmark = pytest.mark.slow
SOURCES = ("pyproject.toml", "README.md", "engine", "ir", "schedules")
CHECK = ("import engine, ir, schedules, engine.testing, importlib.metadata as m; "
         "print(engine.__file__); print(m.version('fnpipe'))")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _fresh_venv(where: Path) -> Path:
    """A venv with nothing installed that sees this interpreter's site-packages (the user's torch)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], where).strip())
    existing = [p for p in {sysconfig.get_path("purelib"), *site.getsitepackages()} if Path(p).is_dir()]
    (purelib / "existing-environment.pth").write_text("\n".join(existing) + "\n")
    return python


def _clone(where: Path) -> Path:
    where.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, where / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, where / name)
    return where


def test_pip_install_then_import_and_train_from_another_directory(tmp_path: Path) -> None:
    """What this test chooses, and why. The README says: install torch (the build for your machine) into your
    environment first, then `pip install .`, and pip keeps that torch. Downloading a 200 MB torch wheel into a
    new venv on every CI run would take minutes and need the network, so the "existing environment" here is
    a fresh venv (no pip of its own, nothing installed) that sees the test interpreter's site-packages
    through a .pth file: torch, attrs, numpy, hypothesis, pip and setuptools are installed there, as they
    would be in a user's environment. fnpipe itself is installed into the fresh venv by pip, from a copy of
    the clone's sources (a build writes build/ and *.egg-info/ next to them), with `--no-index`, so pip
    must find every dependency already installed (it fails if torch were missing rather than fetching
    one), and `--no-build-isolation`, so the build uses the setuptools at hand instead of downloading one.
    What is checked is what a user sees: `import engine, ir, schedules` from another directory resolves to
    the installed copy (not the clone), pip records the distribution, and the README's train.py runs there.
    """
    clone, elsewhere = _clone(tmp_path / "fnpipe"), tmp_path / "my_project"
    elsewhere.mkdir()
    python = _fresh_venv(tmp_path / "venv")
    pip = [str(python), "-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-cache-dir"]
    _run([*pip, "."], clone)
    where, version = _run([str(python), "-c", CHECK], elsewhere).split()
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], elsewhere).strip()
    assert Path(where).is_relative_to(purelib), where  # the installed copy, not the clone
    assert version == "0.2.0"
    train = next(b for b in python_blocks(ROOT / "README.md") if b.file == "train.py")
    (elsewhere / "train.py").write_text(train.code)
    out = _run([str(python), "train.py"], elsewhere)
    assert out.splitlines()[-1].startswith("step 20: loss "), out

    _run([*pip, "-e", "."], clone)  # editable: the clone's own files, still from anywhere
    where, _ = _run([str(python), "-c", CHECK], elsewhere).split()
    assert Path(where).resolve() == (clone / "engine" / "__init__.py").resolve(), where
