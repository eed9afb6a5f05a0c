"""The checkpoint manifest: its format versions and fields, how save writes one, and how load checks one.

A manifest is untrusted input. `read_manifest` refuses anything it does not know (another format, an
unknown or missing field, a value of the wrong type, a shard path that leaves the directory), so what
load acts on is exactly what save wrote. Format 2 records every shard's SHA-256 and size; format 1
(without them) still loads, with a warning on the `engine.checkpoint` logger, its shards unverified.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from torch.utils import _pytree as pytree

from ..errors import CheckpointError
from .checkpoint_files import MANIFEST_FIX, confine

log = logging.getLogger("engine.checkpoint")

FORMAT = "fnpipe-checkpoint/2"
FORMAT_1 = "fnpipe-checkpoint/1"  # no shard digests: "files" is a list of names
MANIFEST = "manifest.json"
TOP = ("format", "fnpipe_version", "iteration", "meta", "world_size", "files", "plan", "params", "opt_state")
TREE = ("treespec", "leaves")
TENSOR_LEAF = ("name", "shape", "dtype", "ranks", "file")
VALUE_LEAF = ("name", "value")
SHARD = ("path", "sha256", "bytes")
NEWER = ("written by a newer fnpipe (or edited by hand): upgrade fnpipe, or export it there "
         "(engine.checkpoint.export) and torch.load the exported file")
DAMAGED = f"the manifest is damaged: {MANIFEST_FIX}"
_is_none = lambda x: x is None  # noqa: E731


# -- writing ----------------------------------------------------------------------------------------
def build(step: Any, size: int, trees: dict, held: list, owner: dict, params: Any, opt_state: Any,
          iteration: int | None, meta: dict | None, files: list[dict]) -> dict:
    """The manifest of a save: `files` is each rank's shard record `{"path", "sha256", "bytes"}`."""
    from ..version import fnpipe_version

    def entries(kind: str) -> list[dict]:
        out = []
        for name, x in trees[kind]:
            holders = [r for r, h in enumerate(held) if name in h[kind]]
            if holders:
                shape, dtype = held[holders[0]][kind][name]
                out.append({"name": name, "shape": shape, "dtype": dtype, "ranks": holders, "file": owner[kind][name]})
            else:  # None, or a plain value (checked by save)
                out.append({"name": name, "value": x})
        return out

    tree = lambda t: {"treespec": pytree.treespec_dumps(pytree.tree_structure(t, is_leaf=_is_none))}  # noqa: E731
    return {
        "format": FORMAT, "fnpipe_version": fnpipe_version(), "iteration": iteration, "meta": meta or {},
        "world_size": size, "files": files,
        "plan": json.loads(step.plan.to_json()) if step is not None else None,
        "params": {**tree(params), "leaves": entries("params")},
        "opt_state": {**tree(opt_state), "leaves": entries("opt_state")} if opt_state is not None else None,
    }


# -- reading ----------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict:
    """The checked manifest of a complete checkpoint (format 1's `files` names become records without a
    digest); CheckpointError if the directory has none, or it is not one this fnpipe wrote and can read."""
    root = Path(path)
    file = root / MANIFEST
    if not file.exists():
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a checkpoint or its save was interrupted; "
                              "load the previous one (engine.checkpoint.latest(root) finds the newest complete)")
    try:
        man = json.loads(file.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{file} is not JSON ({exc}); {DAMAGED}") from exc
    _check_format(file, man)
    _keys(file, "the manifest", man, TOP)
    if man["format"] == FORMAT_1:
        log.warning("%s is format %s, without shard digests: its shards load unverified; save it again with this "
                    "fnpipe to have them checked", file, FORMAT_1)
        man["files"] = [{"path": f, "sha256": None, "bytes": None} for f in _typed(file, "files", man["files"], list)]
    _check_fields(file, man)
    for r, shard in enumerate(man["files"]):
        confine(root, shard["path"], f"files[{r}]")
    return man


def _check_format(file: Path, man: Any) -> None:
    if not isinstance(man, dict):
        raise CheckpointError(f"{file} holds a {type(man).__name__}, not a manifest object; {DAMAGED}")
    fmt = man.get("format")
    if fmt in (FORMAT, FORMAT_1):
        return
    from ..version import fnpipe_version

    found = re.fullmatch(r"fnpipe-checkpoint/(\d+)", fmt) if isinstance(fmt, str) else None
    reads = f"this fnpipe ({fnpipe_version()}) reads {FORMAT!r} and {FORMAT_1!r}"
    if found and int(found[1]) > 2:
        raise CheckpointError(f"{file} has format {fmt!r} (from fnpipe {man.get('fnpipe_version')!r}); {reads}: "
                              f"{NEWER}")
    raise CheckpointError(f"{file} has format {fmt!r}; {reads}: it is not an fnpipe checkpoint manifest, or "
                          f"{DAMAGED}")


def _check_fields(file: Path, man: dict) -> None:
    size = _typed(file, "world_size", man["world_size"], int)
    files = _typed(file, "files", man["files"], list)
    if size < 1 or len(files) != size:
        raise CheckpointError(f"{file}: world_size is {size} but files lists {len(files)} shards; {DAMAGED}")
    for r, shard in enumerate(files):
        _keys(file, f"files[{r}]", shard, SHARD)
        if shard["sha256"] is not None or man["format"] != FORMAT_1:
            if not (isinstance(shard["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", shard["sha256"])):
                raise CheckpointError(f"{file}: files[{r}].sha256 is {shard['sha256']!r}, not a SHA-256 hex digest; "
                                      f"{DAMAGED}")
            if _typed(file, f"files[{r}].bytes", shard["bytes"], int) < 0:
                raise CheckpointError(f"{file}: files[{r}].bytes is {shard['bytes']}, below 0; {DAMAGED}")
    if man["iteration"] is not None:
        _typed(file, "iteration", man["iteration"], int)
    _typed(file, "meta", man["meta"], dict)
    _check_tree(file, "params", man["params"], size)
    if man["opt_state"] is not None:
        _check_tree(file, "opt_state", man["opt_state"], size)


def _check_tree(file: Path, kind: str, tree: Any, size: int) -> None:
    _keys(file, kind, tree, TREE)
    _typed(file, f"{kind}.treespec", tree["treespec"], str)
    for i, leaf in enumerate(_typed(file, f"{kind}.leaves", tree["leaves"], list)):
        where = f"{kind}.leaves[{i}]"
        _keys(file, where, leaf, VALUE_LEAF if isinstance(leaf, dict) and "value" in leaf else TENSOR_LEAF)
        _typed(file, f"{where}.name", leaf["name"], str)
        if "value" in leaf:
            continue
        _typed(file, f"{where}.dtype", leaf["dtype"], str)
        for part in ("shape", "ranks"):
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in _typed(file, f"{where}.{part}",
                                                                                      leaf[part], list)):
                raise CheckpointError(f"{file}: {where}.{part} is {leaf[part]!r}, not a list of integers; {DAMAGED}")
        if not 0 <= _typed(file, f"{where}.file", leaf["file"], int) < size:
            raise CheckpointError(f"{file}: {where}.file is {leaf['file']}, not a shard of files[0..{size - 1}]; "
                                  f"{DAMAGED}")


def _keys(file: Path, where: str, obj: Any, fields: tuple[str, ...]) -> None:
    _typed(file, where, obj, dict)
    unknown, missing = sorted(set(obj) - set(fields)), [f for f in fields if f not in obj]
    if unknown:
        raise CheckpointError(f"{file}: {where} has unknown field(s) {unknown} (format {FORMAT!r} has {list(fields)}); "
                              f"{NEWER}")
    if missing:
        raise CheckpointError(f"{file}: {where} lacks field(s) {missing}; {DAMAGED}")


def _typed(file: Path, where: str, value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"{file}: {where} is {value!r:.80}, not a JSON {_JSON[kind]}; {DAMAGED}")
    return value


_JSON = {dict: "object", list: "array", int: "integer", str: "string"}
