"""engine.plancache: a rerun loads the plan instead of planning; a mismatched file is refused by field."""
from __future__ import annotations

import json

import pytest
import torch

import engine.planning.search
from engine import plancache
from engine.execution.inprocess import build_steps
from engine.plancache import PlanCacheError
from engine.planning.plan import fingerprint
from tests.mpi import models

ARGS = dict(world_size=2, schedule="1f1b", stages=2, microbatches=2, cuts=(14,))


def inputs(layers: int = 4):
    return (models.loss_fn, models.init_params(layers=layers), *models.batch(size=8))


def test_rerun_loads_the_plan_without_planning(tmp_path, monkeypatch):
    first = plancache.load_or_plan(tmp_path, *inputs(), **ARGS)
    assert not first.hit and first.path.parent == tmp_path and first.path.name.startswith("plan-")

    def no_planning(*a, **kw):
        raise AssertionError("planned although the cache holds the plan")

    monkeypatch.setattr(engine.planning.search, "search", no_planning)
    again = plancache.load_or_plan(tmp_path, *inputs(), **ARGS)
    assert again.hit and again.plan == first.plan and again.path == first.path


def test_directory_entries_are_keyed_by_everything_the_plan_depends_on(tmp_path):
    a = plancache.load_or_plan(tmp_path, *inputs(), **ARGS)
    b = plancache.load_or_plan(tmp_path, *inputs(), **{**ARGS, "microbatches": 4})
    c = plancache.load_or_plan(tmp_path, *inputs(layers=3), **{**ARGS, "cuts": (10,)})
    assert not b.hit and not c.hit and len({a.path, b.path, c.path}) == 3
    assert b.plan.microbatches == 4 and c.plan.cuts == (10,)


def test_deployment_file_is_refused_naming_what_differs(tmp_path, monkeypatch):
    file = tmp_path / "deploy.json"
    made = plancache.load_or_plan(file, *inputs(), **ARGS)
    assert not made.hit and file.exists() and plancache.load_or_plan(file, *inputs(), **ARGS).hit
    with pytest.raises(PlanCacheError, match=r"world_size: cached 2, this run 4.*Delete the file"):
        plancache.load_or_plan(file, *inputs(), **{**ARGS, "world_size": 4, "stages": 4})
    with pytest.raises(PlanCacheError, match=r"option microbatches: cached 2, this run 8"):
        plancache.load_or_plan(file, *inputs(), **{**ARGS, "microbatches": 8})
    with pytest.raises(PlanCacheError, match=r"graph_hash: cached '\w+', this run '\w+' \(the model"):
        plancache.load_or_plan(file, *inputs(layers=3), **{**ARGS, "cuts": (10,)})
    with pytest.raises(PlanCacheError, match=r"option memory_limit: cached '<unset>', this run 1000000000"):
        plancache.load_or_plan(file, *inputs(), **{**ARGS, "memory_limit": 10**9})
    monkeypatch.setattr(plancache, "fnpipe_version", lambda: "9.9.9")
    with pytest.raises(PlanCacheError, match=r"fnpipe_version: cached '[^']+', this run '9.9.9'"):
        plancache.load_or_plan(file, *inputs(), **ARGS)


def test_programs_are_recorded_then_checked(tmp_path):
    fn, params, *batch = inputs()
    entry = plancache.load_or_plan(tmp_path, fn, params, *batch, **ARGS)
    programs = [fingerprint(s.program.to_json()) for s in build_steps(fn, params, batch, entry.plan)]
    plancache.record_programs(entry, programs)
    again = plancache.load_or_plan(tmp_path, fn, params, *batch, **ARGS)
    assert again.programs == tuple(programs)
    plancache.record_programs(again, programs)  # same programs: fine
    with pytest.raises(PlanCacheError, match="emits different programs"):
        plancache.record_programs(again, list(reversed(programs)))
    body = json.loads(again.path.read_text())
    assert set(body) == {"format", "key", "plan", "programs"} and body["key"]["world_size"] == 2


def test_unreadable_file_is_refused(tmp_path):
    (tmp_path / "deploy.json").write_text("{not json")
    with pytest.raises(PlanCacheError, match="cannot read plan cache .*delete it"):
        plancache.load_or_plan(tmp_path / "deploy.json", *inputs(), **ARGS)


def test_a_plan_made_with_another_torch_is_not_reused(tmp_path, monkeypatch):
    first = plancache.load_or_plan(tmp_path / "deploy.json", *inputs(), **ARGS)
    monkeypatch.setattr(torch, "__version__", "9.9.0")
    with pytest.raises(PlanCacheError, match=r"torch_version: cached '[^']+', this run '9.9.0'"):
        plancache.load_or_plan(first.path, *inputs(), **ARGS)
