"""The package keeps its own rules: no torch/ir/engine imports, small files, one-line docs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import schedules

PACKAGE = Path(schedules.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))
FORBIDDEN = ("torch", "ir", "engine", "numpy")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_imports_stay_pure(path: Path) -> None:
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                node.module or ""]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
    top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not any("matplotlib" in ast.unparse(n) for n in top_level), path.name


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_shape(path: Path) -> None:
    text = path.read_text()
    tree = _tree(path)
    doc = ast.get_docstring(tree)
    assert doc and "\n" not in doc, f"{path.name}: module docstring must be one line"
    assert "from __future__ import annotations" in text
    assert len(text.splitlines()) < 400
    assert "TODO" not in text and "XXX" not in text
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= 50, f"{path.name}:{node.name} has {length} lines"


def test_public_names_are_exported() -> None:
    assert sorted(schedules.__all__) == sorted(set(schedules.__all__))
    for name in schedules.__all__:
        assert hasattr(schedules, name), name
    assert issubclass(schedules.ScheduleError, ValueError)
