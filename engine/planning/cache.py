"""The plan cache (RaNNC's deployment file): a Plan and its programs as JSON, so a rerun skips planning.

A cache entry is keyed by what the plan depends on: the fnpipe version, the hash of the traced
full-batch graph (ops, shapes, dtypes, leaf names), the world size, the schedule and every planner
option. `load_or_plan(cache, ...)` takes either

  - a directory: the entry lives in `plan-<key digest>.json`; a changed model, world or option is a
    different file, so a rerun with the same inputs skips planning and anything else plans afresh;
  - a `.json` file (a deployment file you keep or ship): used if its key matches, refused with a
    PlanCacheError naming every field that differs if not, written if absent.

Entries are JSON (never pickle), written atomically, and hold each rank's program fingerprint once a
job has emitted them (`record_programs`), so a later run can check that it emits the same programs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch

import ir

from .op_costs import graph_hash
from ..errors import EngineError
from ..version import fnpipe_version
from .artifacts import Planned, Workshop
from .plan import Plan, fingerprint

__all__ = ["CacheKey", "CachedPlan", "PlanCacheError", "cache_key", "entry_path", "fnpipe_version", "load",
           "load_or_plan", "record_programs", "save"]

FORMAT = "fnpipe-plan/3"  # 2: programs recorded as per-rank fingerprints; 3: torch version in the key
log = logging.getLogger("engine.plancache")


class PlanCacheError(EngineError):
    """A plan cache file was made for another model, world, schedule, options or fnpipe version."""


@attrs.frozen
class CacheKey:
    """What a plan depends on; two runs with equal keys get the same plan."""

    fnpipe_version: str
    graph_hash: str
    world_size: int
    schedule: str
    options: dict[str, Any] = attrs.field(converter=lambda d: dict(sorted(d.items())))
    torch_version: str = attrs.field(factory=lambda: torch.__version__)  # op costs and graphs change with torch

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def differences(self, other: dict[str, Any]) -> list[str]:
        """`field: cached X, this run Y` for every field (and option) that differs from `other`."""
        mine, out = self.to_dict(), []
        for field in ("fnpipe_version", "torch_version", "graph_hash", "world_size", "schedule"):
            if other.get(field) != mine[field]:
                note = " (the model, its leaf names or the batch shapes changed)" if field == "graph_hash" else ""
                out.append(f"{field}: cached {other.get(field)!r}, this run {mine[field]!r}{note}")
        theirs = other.get("options", {})
        for name in sorted(set(theirs) | set(mine["options"])):
            if theirs.get(name, "<unset>") != mine["options"].get(name, "<unset>"):
                out.append(f"option {name}: cached {theirs.get(name, '<unset>')!r}, "
                           f"this run {mine['options'].get(name, '<unset>')!r}")
        return out


@attrs.frozen
class CachedPlan:
    """A plan from the cache (`hit`) or freshly made, where it lives, and its programs if recorded."""

    plan: Plan
    key: CacheKey
    path: Path
    hit: bool
    programs: tuple[str, ...] | None = None  # each world rank's program fingerprint, once recorded
    planned: Planned | None = attrs.field(default=None, eq=False)  # on a miss: what planning computed


def cache_key(fn: Any, params: Any, *example_batch: Any, world_size: int, schedule: str, **options: Any) -> CacheKey:
    """Trace `fn` on the full example batch (fake tensors, on cpu so the key is the same on every machine)."""
    graph = ir.trace(fn, params, *example_batch, device="cpu")
    return CacheKey(fnpipe_version(), graph_hash(graph), world_size, schedule,
                    {k: _jsonable(v) for k, v in options.items()})


def _jsonable(v: Any) -> Any:
    if attrs.has(type(v)):
        return {"type": type(v).__name__, **{k: _jsonable(x) for k, x in attrs.asdict(v, recurse=False).items()}}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in sorted(v.items())}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def save(path: str | os.PathLike, key: CacheKey, plan: Plan, programs: Sequence[str] | None = None) -> Path:
    """Write the entry atomically (temp file, fsync, os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "key": key.to_dict(), "plan": json.loads(plan.to_json()),
            "programs": list(programs) if programs is not None else None}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | os.PathLike, key: CacheKey) -> CachedPlan:
    """The entry at `path`; PlanCacheError naming what differs if it was made for another key."""
    path = Path(path)
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanCacheError(f"cannot read plan cache {path}: {exc}; delete it to re-plan") from exc
    if body.get("format") != FORMAT:
        raise PlanCacheError(f"{path} has format {body.get('format')!r}, this fnpipe reads {FORMAT!r}; "
                             "delete it to re-plan")
    diff = key.differences(body.get("key", {}))
    if diff:
        raise PlanCacheError(f"plan cache {path} does not fit this run: " + "; ".join(diff) +
                             ". Delete the file (or give another plan_cache) to re-plan")
    plan = Plan.from_json(json.dumps(body["plan"]))
    programs = tuple(str(p) for p in body["programs"]) if body["programs"] else None
    return CachedPlan(plan, key, path, True, programs)


def entry_path(cache: str | os.PathLike, key: CacheKey) -> Path:
    """`cache` itself if it names a .json file, else `cache/plan-<digest>.json`."""
    cache = Path(cache)
    return cache if cache.suffix == ".json" else cache / f"plan-{key.digest()[:16]}.json"


def load_or_plan(cache: str | os.PathLike, fn: Any, params: Any, *example_batch: Any, world_size: int,
                 schedule: str = "auto", write: bool = True, workshop: Workshop | None = None,
                 build: Any = None, **options: Any) -> CachedPlan:
    """The cached plan for these inputs, or `engine.planning.search.search(...)` with them, saved (if `write`).

    `options` are the planner's keyword arguments (stages, dp, microbatches, memory_limit, device, ...);
    `workshop` and `build` are handed to the search (they are not part of the key)."""
    from . import search

    key = cache_key(fn, params, *example_batch, world_size=world_size, schedule=schedule, **options)
    path = entry_path(cache, key)
    if path.exists():
        entry = load(path, key)
        log.info("plan cache hit: %s", path)
        return entry
    _explain_miss(path, key)
    planned = search.search(fn, params, *example_batch, world_size=world_size, schedule=schedule,
                            workshop=workshop, build=build, **options)
    if write:
        save(path, key, planned.plan)
    return CachedPlan(planned.plan, key, path, False, planned=planned)


def _explain_miss(path: Path, key: CacheKey) -> None:
    """Say why the newest other entry of a cache directory was not used (it is left in place)."""
    others = sorted(path.parent.glob("plan-*.json"), key=lambda p: p.stat().st_mtime) if path.parent.is_dir() else []
    for other in reversed(others):
        try:
            theirs = json.loads(other.read_text()).get("key", {})
        except (OSError, ValueError):
            continue
        log.info("plan cache miss; newest entry %s differs: %s", other.name, "; ".join(key.differences(theirs)))
        return
    log.info("plan cache miss: %s", path)


def record_programs(entry: CachedPlan, programs: Sequence[str], *, write: bool = True) -> None:
    """Store every rank's program fingerprint (in world-rank order) for this plan, or check them against
    the stored ones."""
    if entry.programs is None:
        if write:
            save(entry.path, entry.key, entry.plan, programs)
        return
    cached, emitted = fingerprint(list(entry.programs)), fingerprint(list(programs))
    if cached != emitted:
        raise PlanCacheError(f"{entry.path}: the plan matches but this fnpipe emits different programs for it "
                             f"(fingerprint {emitted[:12]}, cached {cached[:12]}); delete the file to re-plan")
