"""The python blocks of the repository's Markdown files, and how each says it is run."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs

from tests.mpi.jobs import BIN, ROOT, free_port

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# a block's first line may name its file and how it is launched:
#   # train.py: run with `python train.py`, `mpirun -n 2 python train.py` or `torchrun --nproc_per_node 2 train.py`
HEADER = re.compile(r"^# (?P<file>[\w.-]+\.py): run with (?P<how>.+)$")
LAUNCHERS = ("python", "pytest", "mpirun", "torchrun")


@attrs.frozen
class Block:
    """One ```python block: where it is, its code, and (from its header) its file name and commands."""

    doc: str
    line: int
    code: str
    file: str | None = None
    commands: tuple[str, ...] = ()

    @property
    def under_pytest(self) -> bool:
        return any(c.split()[0] == "pytest" for c in self.commands)

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}" + (f" ({self.file})" if self.file else "")


def doc_files() -> list[Path]:
    """The Markdown files git tracks (every *.md under the root outside hidden and venv folders, if this
    is not a git checkout)."""
    try:
        names = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
        return [ROOT / n for n in names]
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in ROOT.rglob("*.md") if not any(part.startswith(".") for part in p.parts))


def python_blocks(path: Path) -> list[Block]:
    """Every ```python block of `path`, in order, with its header parsed."""
    text = path.read_text()
    doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    blocks = []
    for m in FENCE.finditer(text):
        code = m.group(1)
        line = text.count("\n", 0, m.start()) + 2
        head = HEADER.match(code.splitlines()[0]) if code.strip() else None
        if head is None:
            blocks.append(Block(doc, line, code))
            continue
        commands = tuple(re.findall(r"`([^`]+)`", head.group("how")))
        blocks.append(Block(doc, line, code, head.group("file"), commands))
    return blocks


def ranks(command: str) -> int:
    """How many processes a launch command starts (`-n 2`, `--nproc_per_node 2`; 1 otherwise)."""
    found = re.search(r"(?:-n|-np|--nproc_per_node|--nproc-per-node)[ =](\d+)", command)
    return int(found.group(1)) if found else 1


def argv(command: str) -> list[str]:
    """A documented command as this test runs it: `python` is this interpreter, `pytest` its module,
    `mpirun` the venv's, and `torchrun` this interpreter's torch.distributed.run on a free port
    (torchrun's default port may be taken by another job; `--master-port 0` hangs). Nothing else changes."""
    words = shlex.split(command)
    head, rest = words[0], words[1:]
    if head not in LAUNCHERS:
        raise ValueError(f"unknown launcher {head!r} in `{command}`; the docs may use {LAUNCHERS}")
    if head == "mpirun":
        inner = rest.index("python")
        return [str(BIN / "mpirun"), *rest[:inner], sys.executable, *rest[inner + 1:]]
    if head == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()), *rest]
    if head == "pytest":
        return [sys.executable, "-m", "pytest", *rest]
    return [sys.executable, *rest]


def as_one_file(blocks: list[Block]) -> str:
    """The blocks a reader runs in order, as one script: all but those meant for pytest."""
    return "\n".join(f"# ---- {b}\n{b.code}" for b in blocks if not b.under_pytest)


README = ROOT / "README.md"
__all__ = ["Block", "README", "ROOT", "argv", "as_one_file", "doc_files", "python_blocks", "ranks"]
