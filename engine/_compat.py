"""Old flat module paths (`engine.planner`, `engine.tracing`, ...) kept for one release, with a DeprecationWarning."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Sequence

# old path -> new path; these warn on import (removed in fnpipe 0.4)
DEPRECATED = {
    "engine.planner": "engine.planning.search", "engine.blocks": "engine.planning.blocks",
    "engine.split": "engine.planning.split", "engine.layout": "engine.planning.layout",
    "engine.devices": "engine.planning.devices", "engine.memory": "engine.planning.memory",
    "engine.costmodel": "engine.planning.op_costs", "engine.stagecost": "engine.planning.stage_costs",
    "engine.calibrate": "engine.planning.calibration", "engine.instructions": "engine.execution.program",
    "engine.emit": "engine.execution.emit", "engine.runtime": "engine.execution.executor",
    "engine.transport": "engine.execution.transport", "engine.launch": "engine.execution.launch",
    "engine.tracing": "engine.execution.spans", "engine.inprocess": "engine.execution.inprocess",
    "engine.footprint": "engine.execution.footprint", "engine.step": "engine.execution.step",
    "engine.module": "engine.training.module",
}
# public module attributes of `engine` (engine.optim.sgd, ...): importable by their short path, no warning
PUBLIC = {
    "engine.optim": "engine.training.optim", "engine.checkpoint": "engine.training.checkpoint",
    "engine.precision": "engine.training.precision", "engine.plancache": "engine.planning.cache",
}


class _Alias(importlib.abc.Loader):
    """Makes the old path a thin module that forwards every attribute to the new one."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default: a fresh, empty module

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(f"{module.__name__} moved to {self.new}; the old path goes away in fnpipe 0.4",
                      DeprecationWarning, stacklevel=2)
        target = importlib.import_module(self.new)
        module.__getattr__ = lambda name: getattr(target, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(target)  # type: ignore[method-assign]
        module.__doc__ = target.__doc__


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = DEPRECATED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Register the public short paths as the modules themselves; put the finder on `sys.meta_path` once."""
    for old, new in PUBLIC.items():
        sys.modules.setdefault(old, importlib.import_module(new))
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
