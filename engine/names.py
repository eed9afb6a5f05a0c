"""Parameter names as people read them: `blocks.3.qkv.weight` belongs to module `blocks.3`; a stage's
names abbreviate to `wte + blocks.0-3`."""
from __future__ import annotations

from typing import Sequence


def module_key(name: str) -> str:
    """`blocks.3.qkv.weight` -> `blocks.3`; `ln_f.weight` -> `ln_f`: a layer is named up to its index."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _ranges(indices: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def abbreviate(names: Sequence[str]) -> str:
    """Module keys of `names` in order of first appearance, numbered layers folded into ranges:
    ("wte", "blocks.0.w", "blocks.1.w", "blocks.2.w") -> "wte + blocks.0-2"."""
    groups: dict[str, list[int]] = {}
    for key in dict.fromkeys(module_key(n) for n in names):
        head, _, index = key.rpartition(".")
        if head and index.isdigit():
            groups.setdefault(head, []).append(int(index))
        else:
            groups.setdefault(key, [])
    return " + ".join(f"{k}.{_ranges(v)}" if v else k for k, v in groups.items())
