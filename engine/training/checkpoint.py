"""Checkpoints: every rank writes its leaves by name; a manifest, written last, makes one complete.

    engine.checkpoint.save(f"ckpt/{it:06d}", step, params, opt_state, iteration=it)
    ...                                               # later, on any plan (other stage count or dp):
    params, opt_state = engine.checkpoint.load(engine.checkpoint.latest("ckpt"), step, params)

Layout of a checkpoint directory: `rank{r}.pt` holds the tensors rank r owns (a leaf held by several
ranks, across dp replicas or tied stages, is written once, by the lowest rank holding it), as
`{"params": {name: tensor}, "opt_state": {name: tensor}}`; `manifest.json` holds the trees' structure,
every leaf's name, shape, dtype, holders and file, plain-value leaves (the optimizer's step count), the
plan, iteration and `meta`. Files are written to a temp file in the same directory, fsynced and
`os.replace`d; the manifest goes last and is removed first when a directory is overwritten, so a
directory without one is an interrupted save and is never loaded. Use one directory per checkpoint:
the previous one stays intact whatever happens to the next.

Loading goes by leaf name, so the new plan may differ: each rank reads the leaves it now holds from
whichever files have them (memory-mapped: only those bytes are read), with `torch.load(weights_only=True)`.
An optimizer-state leaf whose key path ends with a param's name (`exp_avg.blocks.3.w_q`, as
engine.optim writes it) goes where that param goes; other state tensors go to every rank.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable

import torch
from torch.utils import _pytree as pytree

from ir.trace import key_name

from ..errors import EngineError

__all__ = ["CheckpointError", "export", "is_complete", "latest", "load", "read_manifest", "save"]

FORMAT = "fnpipe-checkpoint/1"
MANIFEST = "manifest.json"
_is_none = lambda x: x is None  # noqa: E731


class CheckpointError(EngineError):
    """A checkpoint is incomplete, or does not match the tree or plan it is loaded into."""


# -- writing ----------------------------------------------------------------------------------------
def save(path: str | os.PathLike, step: Any, params: Any, opt_state: Any = None, *, iteration: int | None = None,
         meta: dict | None = None) -> Path:
    """Write this rank's leaves of `params` (and `opt_state`) into directory `path`; every rank calls it.

    `step` is the engine Step (None when running alone); `meta` is JSON kept in the manifest."""
    path, (rank, size) = Path(path), _rank(step)
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        with contextlib.suppress(FileNotFoundError):
            (path / MANIFEST).unlink()  # from here on the directory is an incomplete checkpoint
        _fsync_dir(path)
    trees = {"params": _named(params), "opt_state": _named(opt_state) if opt_state is not None else []}
    held = _gather(step, {k: {n: _describe(x) for n, x in leaves if isinstance(x, torch.Tensor)}
                          for k, leaves in trees.items()})  # also the barrier: the manifest is gone
    owner = {k: _owners(h[k] for h in held) for k in trees}

    def write_mine() -> None:
        _check_values(trees["opt_state"])
        mine = {k: {n: x.detach().cpu() for n, x in leaves if owner[k].get(n) == rank} for k, leaves in trees.items()}
        _atomic_write(path / f"rank{rank}.pt", lambda f: torch.save(mine, f))

    def write_manifest() -> None:
        if rank == 0:
            manifest = _manifest(step, size, trees, held, owner, params, opt_state, iteration, meta)
            _atomic_write(path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))

    for what, work in (("tensors", write_mine), ("manifest", write_manifest)):
        errors = [e for e in _gather(step, _attempt(rank, work)) if e]  # every rank learns of a failure
        if errors:
            raise CheckpointError(f"saving the {what} of {path} failed ({'; '.join(errors)}); it has no manifest "
                                  "and will not be loaded; other checkpoint directories are untouched")
    return path


def _attempt(rank: int, work: Callable[[], None]) -> str | None:
    try:
        work()
    except Exception as exc:  # noqa: BLE001 -- reported to every rank, so none waits for this one forever
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return None


def _check_values(leaves: list[tuple[str, Any]]) -> None:
    for name, x in leaves:
        if not (x is None or isinstance(x, (torch.Tensor, bool, int, float, str))):
            raise CheckpointError(f"opt_state leaf '{name}' is a {type(x).__name__}; leaves must be tensors, None "
                                  "or plain numbers/strings")


def _manifest(step: Any, size: int, trees: dict, held: list, owner: dict, params: Any, opt_state: Any,
              iteration: int | None, meta: dict | None) -> dict:
    from ..version import fnpipe_version

    def entries(kind: str) -> list[dict]:
        out = []
        for name, x in trees[kind]:
            holders = [r for r, h in enumerate(held) if name in h[kind]]
            if holders:
                shape, dtype = held[holders[0]][kind][name]
                out.append({"name": name, "shape": shape, "dtype": dtype, "ranks": holders, "file": owner[kind][name]})
            else:  # None, or a plain value (checked by _check_values)
                out.append({"name": name, "value": x})
        return out

    tree = lambda t: {"treespec": pytree.treespec_dumps(pytree.tree_structure(t, is_leaf=_is_none))}  # noqa: E731
    return {
        "format": FORMAT, "fnpipe_version": fnpipe_version(), "iteration": iteration, "meta": meta or {},
        "world_size": size, "files": [f"rank{r}.pt" for r in range(size)],
        "plan": json.loads(step.plan.to_json()) if step is not None else None,
        "params": {**tree(params), "leaves": entries("params")},
        "opt_state": {**tree(opt_state), "leaves": entries("opt_state")} if opt_state is not None else None,
    }


def _owners(held: Any) -> dict[str, int]:
    """name -> lowest rank holding it; shapes and dtypes must agree across ranks."""
    owner: dict[str, int] = {}
    seen: dict[str, tuple] = {}
    for r, h in enumerate(held):
        for name, desc in h.items():
            if name in seen and seen[name] != desc:
                raise CheckpointError(f"leaf '{name}' is {seen[name]} on rank {owner[name]} but {desc} on rank {r}")
            seen.setdefault(name, desc)
            owner.setdefault(name, r)
    return owner


# -- reading ----------------------------------------------------------------------------------------
def load(path: str | os.PathLike, step: Any, params_template: Any) -> tuple[Any, Any]:
    """`(params, opt_state)` for this rank of `step`'s plan (None: everything, on one process).

    `params_template` gives the tree (the full params, `step.shard(params)`, or ir.TensorSpecs); names,
    shapes and dtypes must match the checkpoint's. Leaves this rank does not hold come back None."""
    man = read_manifest(path)
    names, spec, template = _template(params_template)
    _check_names(names, [e["name"] for e in man["params"]["leaves"]])
    entries = {e["name"]: e for e in man["params"]["leaves"]}
    for i, name in enumerate(names):
        _check_leaf(name, entries[name], _want(step, i, template[i]))
    local = set(step.local_params) if step is not None else set(range(len(names)))
    need = {"params": {n for i, n in enumerate(names) if i in local and "shape" in entries[n]}}
    state_entries = man["opt_state"]["leaves"] if man["opt_state"] else []
    need["opt_state"] = {e["name"] for e in state_entries if "shape" in e and _state_needed(e["name"], names, local)}
    tensors = _read(Path(path), man, need, step)
    params = pytree.tree_unflatten([tensors["params"].get(n) for n in names], spec)
    if man["opt_state"] is None:
        return params, None
    state_spec = pytree.treespec_loads(man["opt_state"]["treespec"])
    values = [tensors["opt_state"].get(e["name"]) if "shape" in e else e["value"] for e in state_entries]
    return params, pytree.tree_unflatten(values, state_spec)


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint; CheckpointError if the directory has none."""
    file = Path(path) / MANIFEST
    if not file.exists():
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a checkpoint or its save was interrupted; "
                              "load the previous one (engine.checkpoint.latest(root) finds the newest complete)")
    man = json.loads(file.read_text())
    if man.get("format") != FORMAT:
        raise CheckpointError(f"{file} has format {man.get('format')!r}; this fnpipe reads {FORMAT!r}")
    return man


def _template(tree: Any) -> tuple[list[str], pytree.TreeSpec, list[Any]]:
    flat, spec = pytree.tree_flatten_with_path(tree, is_leaf=_is_none)
    return [key_name(p) for p, _ in flat], spec, [x for _, x in flat]


def _check_names(want: list[str], have: list[str]) -> None:
    missing, extra = [n for n in want if n not in set(have)], [n for n in have if n not in set(want)]
    if missing or extra:
        raise CheckpointError(f"the checkpoint's params do not match the template: missing {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                              f"{' ...' if len(extra) > 5 else ''}; load it into the model it was saved from")


def _want(step: Any, i: int, leaf: Any) -> tuple[list[int], str] | None:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return _describe(leaf)
    if step is not None:
        aval = step.graph.inputs[i].aval
        return list(aval.shape), str(aval.dtype)
    return None


def _check_leaf(name: str, entry: dict, want: tuple[list[int], str] | None) -> None:
    if want is None or "shape" not in entry:
        return
    have = (list(entry["shape"]), entry["dtype"])
    if have != (list(want[0]), want[1]):
        raise CheckpointError(f"leaf '{name}': checkpoint has {have[1]}{have[0]}, the model wants {want[1]}"
                              f"{list(want[0])}; load into the model it was saved from (or convert it first)")


def _state_needed(name: str, param_names: list[str], local: set[int]) -> bool:
    """A state leaf follows the param its name ends with (the longest match); others go everywhere."""
    matches = [i for i, p in enumerate(param_names) if name == p or name.endswith("." + p)]
    if not matches:
        return True
    return max(matches, key=lambda i: len(param_names[i])) in local


def _read(path: Path, man: dict, need: dict[str, set[str]], step: Any) -> dict[str, dict[str, torch.Tensor]]:
    device = step.world.device if step is not None else torch.device("cpu")
    by_file: dict[int, list[tuple[str, str]]] = {}
    for kind, names in need.items():
        files = {e["name"]: e["file"] for e in (man[kind] or {"leaves": []})["leaves"] if "file" in e}
        for n in names:
            by_file.setdefault(files[n], []).append((kind, n))
    out: dict[str, dict[str, torch.Tensor]] = {"params": {}, "opt_state": {}}
    for r, wanted in sorted(by_file.items()):
        data = torch.load(path / man["files"][r], map_location="cpu", weights_only=True, mmap=True)
        for kind, n in wanted:
            out[kind][n] = data[kind][n].to(device, copy=True)
    return out


def export(path: str | os.PathLike, step: Any, out_file: str | os.PathLike) -> Path | None:
    """Rank 0 writes one file `{"params", "opt_state", "iteration", "meta"}` with the full trees
    (loadable with `torch.load(weights_only=True)`); other ranks do nothing and return None."""
    if _rank(step)[0] != 0:
        return None
    man = read_manifest(path)
    full: dict[str, Any] = {}
    for kind in ("params", "opt_state"):
        if man[kind] is None:
            full[kind] = None
            continue
        need = {k: ({e["name"] for e in man[k]["leaves"] if "file" in e} if k == kind else set())
                for k in ("params", "opt_state")}
        tensors = _read(Path(path), man, need, None)[kind]
        leaves = [tensors.get(e["name"]) if "file" in e else e.get("value") for e in man[kind]["leaves"]]
        full[kind] = pytree.tree_unflatten(leaves, pytree.treespec_loads(man[kind]["treespec"]))
    out = Path(out_file)
    payload = {**full, "iteration": man["iteration"], "meta": man["meta"]}
    _atomic_write(out, lambda f: torch.save(payload, f))
    return out


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).exists()


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint under `root` with the highest iteration (then the newest manifest)."""
    found = []
    for d in Path(root).iterdir() if Path(root).is_dir() else ():
        if is_complete(d):
            with contextlib.suppress(CheckpointError, ValueError):
                it = read_manifest(d)["iteration"]
                found.append((it if it is not None else -1, (d / MANIFEST).stat().st_mtime_ns, d))
    return max(found)[2] if found else None


# -- helpers ----------------------------------------------------------------------------------------
def _named(tree: Any) -> list[tuple[str, Any]]:
    return [(key_name(p), x) for p, x in pytree.tree_flatten_with_path(tree, is_leaf=_is_none)[0]]


def _describe(x: Any) -> tuple[list[int], str]:
    return list(x.shape), str(x.dtype)


def _rank(step: Any) -> tuple[int, int]:
    return (0, 1) if step is None else (step.world.rank, step.world.size)


def _gather(step: Any, obj: Any) -> list[Any]:
    return [obj] if step is None or step.world.size == 1 else step.transport.all_gather_json(obj)


def _atomic_write(target: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Temp file in the same directory, fsync, os.replace: readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
