"""Checkpoints: every rank writes its leaves by name; a manifest, written last, makes one complete.

    engine.checkpoint.save(f"ckpt/{it:06d}", step, params, opt_state, iteration=it)
    ...                                               # later, on any plan (other stage count or dp):
    params, opt_state = engine.checkpoint.load(engine.checkpoint.latest("ckpt"), step, params)

Layout of a checkpoint directory: `rank{r}.pt` holds the tensors rank r owns (a leaf held by several
ranks, across dp replicas or tied stages, is written once, by the lowest rank holding it), as
`{"params": {name: tensor}, "opt_state": {name: tensor}}`; `manifest.json` (checkpoint_manifest.py)
holds every shard's path, SHA-256 and size, the trees' structure, every leaf's name, shape, dtype,
holders and file, plain-value leaves (the optimizer's step count), the plan, iteration and `meta`.
Files are written to a temp file in the same directory, fsynced, hashed and `os.replace`d; the manifest
goes last and is removed first when a directory is overwritten, so a directory without one is an
interrupted save and is never loaded. A rank whose write fails (a full disk: ENOSPC) makes save raise
CheckpointError on every rank, naming the rank and the error, and no manifest is written. Use one
directory per checkpoint: the previous one stays intact whatever happens to the next.

Loading goes by leaf name, so the new plan may differ: each rank reads the leaves it now holds from
whichever files have them, with `torch.load(weights_only=True)`. Before a shard is read its size and
SHA-256 are checked against the manifest (so each shard a rank needs is read once in full to hash it;
the load itself is memory-mapped); a flipped bit, a truncated file or swapped shards raise
CheckpointError naming the file, what was expected and found, and the fix. The manifest is untrusted:
unknown format versions or fields are refused, and so is any shard path that is absolute, contains `..`
or resolves (symlinks followed) outside the directory. Every rank calls load, and the ranks' verdicts
are all-gathered as JSON, so when any rank's check fails every rank raises, and none keeps half a load.
Format-1 manifests (before digests) still load, with a warning on the `engine.checkpoint` logger and
their shards unverified; save them again to have them checked.
An optimizer-state leaf whose key path ends with a param's name (`exp_avg.blocks.3.w_q`, as
engine.optim writes it) goes where that param goes; other state tensors go to every rank.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ir.trace import key_name

from ..errors import CheckpointError
from .checkpoint_files import atomic_write, confine, fsync_dir, verify
from .checkpoint_manifest import FORMAT, MANIFEST, build, read_manifest  # noqa: F401 -- FORMAT stays importable here

__all__ = ["CheckpointError", "export", "is_complete", "latest", "load", "read_manifest", "save"]

log = logging.getLogger("engine.checkpoint")
_is_none = lambda x: x is None  # noqa: E731
SAVE_FAILED = ("it has no manifest and will not be loaded; other checkpoint directories are untouched; fix the "
               "cause (a full disk: free space) and save again")


# -- writing ----------------------------------------------------------------------------------------
def save(path: str | os.PathLike, step: Any, params: Any, opt_state: Any = None, *, iteration: int | None = None,
         meta: dict | None = None) -> Path:
    """Write this rank's leaves of `params` (and `opt_state`) into directory `path`; every rank calls it,
    and a failure on any rank (a full disk) raises CheckpointError on all of them, with no manifest written.

    `step` is the engine Step (None when running alone); `meta` is JSON kept in the manifest."""
    path, (rank, size) = Path(path), _rank(step)
    trees = {"params": _named(params), "opt_state": _named(opt_state) if opt_state is not None else []}

    def prepare() -> tuple[None, dict]:
        path.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            with contextlib.suppress(FileNotFoundError):
                (path / MANIFEST).unlink()  # from here on the directory is an incomplete checkpoint
            fsync_dir(path)
        return None, {k: {n: _describe(x) for n, x in leaves if isinstance(x, torch.Tensor)}
                      for k, leaves in trees.items()}

    # also the barrier: no rank writes a shard before the old manifest is gone
    _, held = _settle(step, f"preparing {path}", "nothing was written; fix the cause and save again", prepare)
    owner = {k: _owners(h[k] for h in held) for k in trees}

    def write_mine() -> tuple[None, dict]:
        _check_values(trees["opt_state"])
        mine = {k: {n: x.detach().cpu() for n, x in leaves if owner[k].get(n) == rank} for k, leaves in trees.items()}
        name = f"rank{rank}.pt"
        return None, {"path": name, **atomic_write(path / name, lambda f: torch.save(mine, f))}

    _, files = _settle(step, f"saving the tensors of {path}", SAVE_FAILED, write_mine)

    def write_manifest() -> tuple[None, None]:
        if rank == 0:
            manifest = build(step, size, trees, held, owner, params, opt_state, iteration, meta, files)
            atomic_write(path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        return None, None

    _settle(step, f"saving the manifest of {path}", SAVE_FAILED, write_manifest)
    return path


def _settle(step: Any, what: str, after: str, work: Callable[[], tuple[Any, Any]]) -> tuple[Any, list[Any]]:
    """Run `work` here, then all-gather every rank's verdict (and the JSON `shared` part of its result), so
    a failure on any rank raises CheckpointError on all of them and none waits for a peer forever.

    `work()` returns `(local, shared)`; `_settle` returns this rank's `local` and every rank's `shared`."""
    local = shared = cause = error = None
    try:
        local, shared = work()
    except Exception as exc:  # noqa: BLE001 -- reported to every rank
        cause, error = exc, _explain(exc)
    verdicts = _gather(step, {"error": error, "shared": shared})
    failed: dict[str, list[int]] = {}
    for r, v in enumerate(verdicts):
        if v["error"]:
            failed.setdefault(v["error"], []).append(r)
    if failed:
        many = len(verdicts) > 1
        details = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {e}" if many else e
                            for e, rs in failed.items())
        raise CheckpointError(f"{what} failed ({details}){'; ' + after if after else ''}") from cause
    return local, [v["shared"] for v in verdicts]


def _explain(exc: Exception) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    code = f" [{errno.errorcode[exc.errno]}]" if isinstance(exc, OSError) and exc.errno in errno.errorcode else ""
    return f"{type(exc).__name__}: {exc}{code}"


def _check_values(leaves: list[tuple[str, Any]]) -> None:
    for name, x in leaves:
        if not (x is None or isinstance(x, (torch.Tensor, bool, int, float, str))):
            raise CheckpointError(f"opt_state leaf '{name}' is a {type(x).__name__}; leaves must be tensors, None "
                                  "or plain numbers/strings")


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
    """`(params, opt_state)` for this rank of `step`'s plan (None: everything, on one process); every
    rank calls it, and if any rank's checks fail, all of them raise CheckpointError.

    `params_template` gives the tree (the full params, `step.shard(params)`, or ir.TensorSpecs); names,
    shapes and dtypes must match the checkpoint's. Leaves this rank does not hold come back None."""
    def here() -> tuple[tuple[Any, Any], None]:
        return _load_here(Path(path), step, params_template), None  # nothing to share but the verdict

    return _settle(step, f"loading the checkpoint {path}", "", here)[0]


def _load_here(path: Path, step: Any, params_template: Any) -> tuple[Any, Any]:
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
    tensors = _read(path, man, need, step)
    params = pytree.tree_unflatten([tensors["params"].get(n) for n in names], spec)
    if man["opt_state"] is None:
        return params, None
    state_spec = pytree.treespec_loads(man["opt_state"]["treespec"])
    values = [tensors["opt_state"].get(e["name"]) if "shape" in e else e["value"] for e in state_entries]
    return params, pytree.tree_unflatten(values, state_spec)


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
        record = man["files"][r]
        file = confine(path, record["path"], f"files[{r}]")
        verify(file, record, man["files"])  # before torch.load sees a byte of it
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        for kind, n in wanted:
            part = data.get(kind) if isinstance(data, dict) else None
            if not isinstance(part, dict) or not isinstance(part.get(n), torch.Tensor):
                raise CheckpointError(f"checkpoint shard {file} has no {kind} tensor '{n}', which the manifest puts "
                                      "there; restore the file from a copy, or load an earlier checkpoint")
            out[kind][n] = part[n].to(device, copy=True)
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
    atomic_write(out, lambda f: torch.save(payload, f))
    return out


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).exists()


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint under `root` with the highest iteration (then the newest manifest); one
    whose manifest cannot be read is skipped with a warning. Shards are checked by load, not here."""
    found = []
    for d in Path(root).iterdir() if Path(root).is_dir() else ():
        if is_complete(d):
            try:
                it = read_manifest(d)["iteration"]
            except CheckpointError as exc:
                log.warning("engine.checkpoint.latest skips %s: %s", d, exc)
                continue
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
