"""Every make target named in the Makefile, the docs or CI has a rule, and make accepts it (a dry run)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, doc_files
from tests.mpi.jobs import job_env

MAKEFILE = (ROOT / "Makefile").read_text()
RULES = set(re.findall(r"^([\w.-]+):(?!=)", MAKEFILE, re.M))
PHONY = set(re.search(r"^\.PHONY:(.*)$", MAKEFILE, re.M).group(1).split())


def _named() -> dict[str, set[str]]:
    """Target -> where it is named: `.PHONY`, and `make x` as code (a line or inline code) in a tracked
    Markdown file or in .ci/run."""
    named: dict[str, set[str]] = {t: {".PHONY"} for t in PHONY}
    for path in [*doc_files(), ROOT / ".ci" / "run"]:
        for target in re.findall(r"(?:^|`)make ([a-z][\w-]*)", path.read_text(), re.M):  # commands, not prose
            named.setdefault(target, set()).add(str(path.relative_to(ROOT)))
    return named


NAMED = _named()


def _dry_run(target: str, tmp_path: Path) -> str:
    """`make -n target` with a venv path that does not exist: prints every command, runs none."""
    done = subprocess.run(["make", "-n", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", target],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"make -n {target}: {done.stderr}"
    return done.stdout


def test_the_docs_name_the_targets_users_run() -> None:
    assert {"demo", "test", "test-fast"} <= {t for t, where in NAMED.items() if "README.md" in where}, NAMED


@pytest.mark.parametrize("target", sorted(NAMED))
def test_every_named_target_has_a_rule(target: str, tmp_path: Path) -> None:
    assert target in RULES, f"`make {target}` is named in {sorted(NAMED[target])} but the Makefile has no rule"
    assert _dry_run(target, tmp_path).strip()


def test_test_fast_runs_the_suite_without_multi_process_and_slow_tests(tmp_path: Path) -> None:
    """The command `make test-fast` runs, collected here: most of the suite, none of the mpi tests."""
    line = next(ln for ln in _dry_run("test-fast", tmp_path).splitlines() if " -m pytest " in ln)
    words = shlex.split(line)
    cmd = [sys.executable, *words[words.index("-m"):], "--collect-only"]
    done = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", done.stdout)
    assert found and int(found[1]) > 0.8 * int(found[2]) and int(found[3]) > 0, done.stdout[-500:]
    assert "test_failures.py" not in done.stdout and "test_install.py" not in done.stdout
