"""engine/'s folders are its architecture: planning never imports execution, and each subpackage keeps its rules."""
from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import engine

ROOT = Path(engine.__file__).parent
SHARED = {"engine.errors", "engine.names", "engine.logs", "engine.progress", "engine.units", "engine.version",
          "engine.setup_clock"}
# what each subpackage may import from engine (besides itself and SHARED)
ALLOWED = {
    "planning": set(),
    "execution": {"engine.planning"},
    "training": set(),
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _engine_imports(path: Path) -> set[str]:
    """Every engine module `path` imports, at the top or inside a function, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "engine"}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] != "engine":
                continue
            names = [f"{module}.{a.name}" for a in node.names] if not node.module else [module]
            found |= set(names)
    return found


def _owner(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_subpackage_imports_only_what_its_docstring_allows(sub: str) -> None:
    bad = []
    for path in sorted((ROOT / sub).rglob("*.py")):
        for target in _engine_imports(path):
            owner = _owner(target)
            ok = (owner == sub or any(target == s or target.startswith(s + ".") for s in SHARED)
                  or any(target == a or target.startswith(a + ".") for a in ALLOWED[sub]))
            if not ok:
                bad.append(f"{path.relative_to(ROOT.parent)} imports {target}")
    assert not bad, "\n".join(bad)


def test_planning_never_imports_execution() -> None:
    """The rule the layout exists for; calibration runs programs through a compiler it is handed."""
    offenders = [f"{p.name}: {t}" for p in (ROOT / "planning").rglob("*.py") for t in _engine_imports(p)
                 if _owner(t) in {"execution", "training", "parallelize", "report", "testing"}]
    assert offenders == []


def test_the_checker_sees_a_lazy_relative_import(tmp_path: Path) -> None:
    """The rule test must be able to fail: a function-level `from ..execution import x` is found."""
    fake = ROOT / "planning" / "_probe_for_test.py"
    fake.write_text("def f():\n    from ..execution.executor import Executor\n")
    try:
        assert "engine.execution.executor" in _engine_imports(fake)
    finally:
        fake.unlink()


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_each_subpackage_says_what_it_owns_and_may_import(sub: str) -> None:
    doc = importlib.import_module(f"engine.{sub}").__doc__ or ""
    assert "Owns" in doc and "May import" in doc and "Must not import" in doc, doc


@pytest.mark.parametrize("old,new", [("engine.planner", "engine.planning.search"),
                                     ("engine.tracing", "engine.execution.spans"),
                                     ("engine.step", "engine.execution.step")])
def test_old_import_paths_work_with_a_deprecation_warning(old: str, new: str) -> None:
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        mod = importlib.import_module(old)
    target = importlib.import_module(new)
    public = [n for n in dir(target) if not n.startswith("_")]
    assert public and all(getattr(mod, n) is getattr(target, n) for n in public)


def test_public_api_is_unchanged() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import engine.optim
        from engine import checkpoint, optim, plancache, testing  # noqa: F401
    assert callable(engine.parallelize) and callable(engine.plan) and callable(engine.functionalize)
    assert engine.optim.sgd is optim.sgd and isinstance(engine.Step, type) and isinstance(engine.Plan, type)
