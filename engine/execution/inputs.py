"""What a step takes: its params and batch checked against the plan on each rank, and compared across ranks.

`Inputs.problem` looks at one rank's arguments alone (tree structure, each leaf's type, shape, dtype and
device) and never communicates, so bad input raises on every rank that got it, before the pipeline
starts. `Inputs.agree` is the cross-rank check (`check_inputs`): one all-gather of a few int64 per leaf
(`fingerprints`), after which every rank reaches the same verdict: a rank that refused its inputs, or
ranks that hold different values where they must hold equal ones, make every rank raise InputError.
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

import ir
from ir.loss import children
from ir.trace import key_name

from ..errors import InputError, PlanError
from . import launch

CHECKS = ("first", "every", "never")
SHARD_FIX = "pass the tree returned by step.shard(params)"
BATCH_FIX = ("every rank must pass the same full batch (each rank takes its share): seed its random draws "
             "(torch.manual_seed) or load it alike on every rank")
PARAMS_FIX = ("every rank must start from the same params: seed their initialisation (torch.manual_seed) on every "
              "rank, or make them on rank 0 and broadcast them; the copies several ranks hold must get equal updates")
# a refusal's kind, as sent to the peers (an int in the gathered vector) and as they name it
KINDS = {1: "the params tree", 2: "param", 3: "the batch's structure", 4: "batch leaf"}
_RAMP = 65521  # a prime: the index-weighted sum tells a permutation or a shifted row apart
_CHUNK = 1 << 22  # words per pass, so a large leaf needs only a bounded temporary
_SMALL = 1 << 12  # elements: leaves smaller than this are fingerprinted together (`_fingerprint_together`),
_GROUP = 1 << 18  # in runs of at most this many elements (temporaries of ~24 bytes an element; larger runs were
                  # slower than leaf by leaf on an H100, and took 0.9 GiB for 200 leaves of 65,535)


def check_mode(check_inputs: str) -> str:
    """`check_inputs` itself, or PlanError naming the valid values."""
    if check_inputs not in CHECKS:
        raise PlanError(f"check_inputs must be one of {', '.join(map(repr, CHECKS))}, got {check_inputs!r}: "
                        "'first' compares the ranks' inputs on the first step, 'every' on every step")
    return check_inputs


@attrs.frozen
class Problem:
    """A rank's refusal of its own inputs: the error it raises and what its peers are told (kind, leaf)."""

    error: InputError
    kind: int
    leaf: int = -1


def fingerprints(leaves: Sequence[Any]) -> torch.Tensor:
    """int64[n, 4] per leaf: [1, sum, index-weighted sum, sum of squares] of its bytes read as integers, or
    zeros for a leaf with no data (None, a meta tensor, a spec). Integer sums wrap alike on every rank and
    in any order, so equal tensors give equal rows on every rank and device."""
    out = torch.zeros(len(leaves), 4, dtype=torch.int64)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            by_device.setdefault(x.device, []).append(i)
    for device, rows in by_device.items():  # one copy to the CPU per device, not one per leaf
        groups = _groups([i for i in rows if leaves[i].numel() < _SMALL], leaves)
        large = [i for i in rows if leaves[i].numel() >= _SMALL]
        order = [i for group in groups for i in group] + large
        sums = [_fingerprint_together([leaves[i] for i in group]) for group in groups]
        sums += [torch.stack([_fingerprint(leaves[i]) for i in large])] if large else []
        out[rows, 0] = 1
        out[order, 1:] = torch.cat(sums).cpu()
    return out


def _groups(small: Sequence[int], leaves: Sequence[Any]) -> list[list[int]]:
    """`small` (leaf indices) in runs of at most _GROUP elements in all, so each run's temporaries stay bounded."""
    groups: list[list[int]] = []
    total = 0
    for i in small:
        if not groups or total + leaves[i].numel() > _GROUP:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += leaves[i].numel()
    return groups


def _words(x: torch.Tensor) -> torch.Tensor:
    """`x`'s bytes as 1-, 2- or 4-byte integers, flat."""
    flat = x.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a one-element view keeps its stride: `contiguous` leaves it as it is
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view({1: torch.uint8, 2: torch.int16}.get(flat.element_size(), torch.int32)) if flat.numel() else flat


def _sums(w: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[word, word x ramp, word^2] per word (int64), the ramp from each word's position in its leaf."""
    return torch.stack([w, w * (position % _RAMP + 1), w * w], dim=1)


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """[sum, index-weighted sum, sum of squares] of `x`'s bytes as 1-, 2- or 4-byte integers, on its device."""
    words = _words(x)
    sums = torch.zeros(3, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        sums += _sums(w, torch.arange(start, start + w.numel(), device=w.device)).sum(0)
    return sums


def _fingerprint_together(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """`_fingerprint` of each of many small tensors on one device, as one [n, 3] in a few kernels (leaf by leaf,
    a step's check of a model's many small leaves cost ~0.1 ms each). Integer sums in any order are equal."""
    words = [_words(x).to(torch.int64) for x in xs]
    device = words[0].device
    counts = torch.tensor([w.numel() for w in words], device=device)
    leaf = torch.repeat_interleave(torch.arange(len(words), device=device), counts)
    position = torch.arange(leaf.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[leaf]
    running = torch.cat([torch.zeros(1, 3, dtype=torch.int64, device=device),
                         _sums(torch.cat(words), position).cumsum(0)])  # wraps alike everywhere: exact
    ends = torch.cumsum(counts, 0)
    return running[ends] - running[ends - counts]


class Inputs:
    """The params and batch one rank's step was planned for, and how often the ranks compare theirs."""

    def __init__(self, graph: ir.Graph, *, microbatches: int, dp: int, holders: dict[int, tuple[int, ...]],
                 local: Sequence[int], world: launch.World, check: str = "first") -> None:
        self.graph, self.holders, self.local = graph, holders, tuple(local)
        self.microbatches, self.dp, self.parts = microbatches, dp, microbatches * dp
        self.world, self.check = world, check_mode(check)
        self.checked = False
        self.shard_prints: torch.Tensor | None = None  # what this rank gave step.shard, until compared

    @property
    def num_batch(self) -> int:
        return len(self.graph.inputs) - self.graph.num_params

    def name(self, kind: int, leaf: int) -> str:
        if kind == 2:
            return f"param '{self.graph.input_names[leaf]}'"
        if kind == 4:
            return f"batch leaf '{self.graph.input_names[self.graph.num_params + leaf]}'"
        return KINDS[kind]

    def forget(self) -> None:
        """As before any step: the next one compares the ranks' inputs again (steps the engine ran on the example
        batch, `rebalance="step"`, are not the user's first)."""
        self.checked, self.shard_prints = False, None

    def due(self, world_size: int) -> bool:
        """Whether this step compares the ranks' inputs (the same answer on every rank)."""
        return world_size > 1 and (self.check == "every" or (self.check == "first" and not self.checked))

    # -- one rank, no communication ---------------------------------------------------------------
    def problem(self, params: Any, batch: Sequence[Any], flat: tuple[list[Any], pytree.TreeSpec] | None = None
                ) -> Problem | None:
        """The first thing wrong with this rank's params (the tree from step.shard) or batch, or None; `flat`: the
        params already flattened (`pytree.tree_flatten` with None as a leaf), not flattened again."""
        return self._params_problem(params, flat) or self._batch_problem(batch)

    def _params_problem(self, params: Any, flat: tuple[list[Any], pytree.TreeSpec] | None = None) -> Problem | None:
        leaves, spec = flat if flat is not None else pytree.tree_flatten(params, is_leaf=lambda x: x is None)
        g, rank = self.graph, self.world.rank
        wrong = _tree_difference(params, spec, g.input_names[:g.num_params], self._params_spec())
        if len(leaves) != g.num_params or wrong:
            return Problem(InputError(f"params has {len(leaves)} leaves, the traced function {g.num_params}"
                                      f"{wrong}; {SHARD_FIX}"), 1)
        for pid in self.local:
            x, want = leaves[pid], g.inputs[pid].aval
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want.shape or x.dtype != want.dtype:
                got = ir.AbstractValue.of(x) if isinstance(x, torch.Tensor) else repr(x)
                return Problem(InputError(f"param '{g.input_names[pid]}' on rank {rank} should be {want}, got "
                                          f"{got}; pass the tree from step.shard(params)"), 2, pid)
            if x.device != self.world.device:
                return Problem(InputError(f"param '{g.input_names[pid]}' on rank {rank} is on {x.device}, this "
                                          f"rank runs on {self.world.device}; pass the tree from step.shard(params) "
                                          "(it moves this rank's leaves there)"), 2, pid)
        return None

    def _params_spec(self) -> pytree.TreeSpec | None:
        return children(self.graph.in_tree)[0] if self.graph.in_tree is not None else None

    def _batch_specs(self) -> list[pytree.TreeSpec] | None:
        return children(self.graph.in_tree)[1:] if self.graph.in_tree is not None else None

    def _batch_problem(self, batch: Sequence[Any]) -> Problem | None:
        g, specs = self.graph, self._batch_specs()
        names = g.input_names[g.num_params:]
        if specs is not None:
            given = [pytree.tree_structure(b) for b in batch]
            if len(batch) != len(specs) or given != specs:
                what = (f"the step was given {len(batch)} batch argument{'s' if len(batch) != 1 else ''}, it was "
                        f"planned for {len(specs)}" if len(batch) != len(specs)
                        else "; ".join(f"batch argument {k + 1} is {_describe(a)}, the step was planned for "
                                       f"{_describe(b)}" for k, (a, b) in enumerate(zip(given, specs)) if a != b))
                return Problem(InputError(f"{what} (planned batch leaves: {', '.join(names)}); pass the batch as the "
                                          "example batch was passed to engine.parallelize"), 3)
        leaves = pytree.tree_leaves(tuple(batch))
        if len(leaves) != len(names):
            return Problem(InputError(f"the batch has {len(leaves)} leaves, the step was planned for {len(names)} "
                                      f"({', '.join(names)}); pass the batch as the example batch was passed to "
                                      "engine.parallelize"), 3)
        for j, x in enumerate(leaves):
            message = self._leaf_problem(names[j], x, g.batch[j].aval)
            if message is not None:
                return Problem(InputError(message), 4, j)
        return None

    def _leaf_problem(self, name: str, x: Any, mb: ir.AbstractValue) -> str | None:
        rows = mb.shape[0] * self.parts if mb.shape else 0
        want = ir.AbstractValue((rows, *mb.shape[1:]), mb.dtype)
        if not isinstance(x, torch.Tensor):
            return (f"batch leaf '{name}' is a {type(x).__name__}, the step was planned for a tensor {want}; pass "
                    "tensors")
        got = ir.AbstractValue.of(x)
        if x.dtype != want.dtype:
            return (f"batch leaf '{name}' is {got}, the step was planned for {want}; cast it "
                    f"(`.to({want.dtype})`), or call engine.parallelize again with an example batch of {x.dtype}")
        if got.shape != want.shape:
            if got.shape[1:] == want.shape[1:] and got.shape:
                split = f"{self.microbatches} microbatches of {mb.shape[0]} rows" + (
                    f" on each of {self.dp} replicas" if self.dp > 1 else "")
                fix = (f"pass batches of {rows} rows ({split}), or call engine.parallelize again with an example "
                       f"batch of {got.shape[0]} rows")
            else:
                fix = "pass a batch shaped like the example batch given to engine.parallelize"
            return f"batch leaf '{name}' is {got}, the step was planned for {want}; {fix}"
        if x.device not in (self.world.device, torch.device("cpu")):
            where = "the CPU" if self.world.device.type == "cpu" else f"{self.world.device} or on the CPU (the " \
                "step moves them there)"
            return f"batch leaf '{name}' is on {x.device}, the step runs on {self.world.device}; pass tensors on {where}"
        return None

    def shard_problem(self, params: Any) -> InputError | None:
        """What is wrong with the full params tree given to step.shard: its tree, a tensor leaf's shape or
        dtype, or a leaf this rank holds that is not a tensor (other ranks' leaves may be None or specs)."""
        leaves, spec = pytree.tree_flatten(params, is_leaf=lambda x: x is None)
        g, fix = self.graph, "pass the params tree given to engine.parallelize"
        wrong = _tree_difference(params, spec, g.input_names[:g.num_params], self._params_spec())
        if len(leaves) != g.num_params or wrong:
            return InputError(f"step.shard was given {len(leaves)} leaves, the traced function takes "
                              f"{g.num_params}{wrong}; {fix}")
        for pid, x in enumerate(leaves):
            want, name = g.inputs[pid].aval, g.input_names[pid]
            if isinstance(x, torch.Tensor) and (tuple(x.shape) != want.shape or x.dtype != want.dtype):
                return InputError(f"param '{name}' given to step.shard is {ir.AbstractValue.of(x)}, the traced "
                                  f"function takes {want}; {fix}")
            if pid in set(self.local) and not isinstance(x, torch.Tensor):
                return InputError(f"param '{name}' given to step.shard on rank {self.world.rank} is {x!r}, and "
                                  f"this rank holds it; {fix}, with tensors for every leaf")
        return None

    # -- across ranks -----------------------------------------------------------------------------
    def record_shard(self, params: Any) -> None:
        """Fingerprint every leaf given to step.shard, for the next cross-rank check to compare."""
        self.shard_prints = fingerprints(pytree.tree_leaves(params, is_leaf=lambda x: x is None))

    def agree(self, transport: Any, problem: Problem | None, params: Any, batch: Sequence[Any]) -> None:
        """The cross-rank check (a collective): every rank raises InputError if any rank refused its inputs
        or the ranks disagree; this rank's own refusal is raised as it is."""
        n_params, n_batch = self.graph.num_params, self.num_batch
        vector = torch.zeros(2 + 4 * (n_batch + 2 * n_params), dtype=torch.int64)
        if problem is not None:
            vector[0], vector[1] = problem.kind, problem.leaf
        else:
            leaves = pytree.tree_leaves(params, is_leaf=lambda x: x is None)
            held = set(self.local)
            local = [leaves[i] if i in held else None for i in range(n_params)]
            shard = self.shard_prints if self.shard_prints is not None and len(self.shard_prints) == n_params \
                else torch.zeros(n_params, 4, dtype=torch.int64)
            prints = torch.cat([fingerprints(pytree.tree_leaves(tuple(batch))), fingerprints(local), shard])
            vector[2:] = prints.reshape(-1)
        rows = torch.stack(transport.all_gather(vector))
        self.shard_prints = None
        if problem is not None:
            raise problem.error
        refused = [(r, int(v[0]), int(v[1])) for r, v in enumerate(rows) if int(v[0]) != 0]
        if refused:
            r, kind, leaf = refused[0]
            raise InputError(f"rank {r} refused its inputs ({self.name(kind, leaf)}: its own error says what is "
                             "wrong and the fix), so no rank runs this step")
        differ = self._differences(rows[:, 2:].reshape(len(rows), -1, 4))
        if differ:
            fixes = [fix for fix, word in ((BATCH_FIX, "batch leaf"), (PARAMS_FIX, "param ")) if any(
                d.startswith(word) for d in differ)]
            raise InputError("the ranks' inputs differ: " + "; ".join(differ[:3]) +
                             (f"; and {len(differ) - 3} more" if len(differ) > 3 else "") + "; " + "; ".join(fixes))
        self.checked = True

    def _differences(self, prints: torch.Tensor) -> list[str]:
        """`<leaf> differs between ranks [0] and [1]` for each leaf whose present rows are not all equal."""
        n_params, n_batch, g = self.graph.num_params, self.num_batch, self.graph
        rows = prints.tolist()  # Python ints: indexing the tensor element by element took seconds at many leaves
        out = []
        for i in range(prints.shape[1]):
            section, leaf = (0, i) if i < n_batch else divmod(i - n_batch, n_params)
            groups: dict[tuple[int, ...], list[int]] = {}
            for r, row in enumerate(rows):
                if row[i][0]:
                    groups.setdefault(tuple(row[i][1:]), []).append(r)
            if len(groups) < 2:
                continue
            ranks = " and ".join(str(rs) for rs in sorted(groups.values()))
            if i < n_batch:
                out.append(f"batch leaf '{g.input_names[n_params + leaf]}' differs between ranks {ranks}")
            elif section == 0:
                held = list(self.holders.get(leaf, ()))
                out.append(f"param '{g.input_names[leaf]}' (held by ranks {held}) differs between ranks {ranks}")
            else:
                out.append(f"param '{g.input_names[leaf]}' given to step.shard differs between ranks {ranks}")
        return out


def _describe(spec: pytree.TreeSpec) -> str:
    """`a tensor`, `a dict with keys ['a', 'b']`, `a tuple of 3`: a batch argument's structure, briefly."""
    if spec.is_leaf():
        return "a tensor"
    kind = spec.type.__name__ if spec.type is not None else "container"
    if spec.type is dict:
        return f"a dict with keys {list(spec.context)}"
    return f"a {kind} of {spec.num_children}"


def _tree_difference(tree: Any, spec: pytree.TreeSpec, names: Sequence[str], want: pytree.TreeSpec | None) -> str:
    """` (missing 'a'; unexpected 'b')`: how a tree's leaf names differ from the traced ones; '' if alike."""
    if want is not None and spec == want:
        return ""
    given = [key_name(p) for p, _ in pytree.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]]
    missing = [n for n in names if n not in set(given)]
    extra = [n for n in given if n not in set(names)]
    parts = [f"{label} {', '.join(repr(n) for n in items[:4])}{' ...' if len(items) > 4 else ''}"
             for label, items in (("missing", missing), ("unexpected", extra)) if items]
    if not parts and want is not None:
        parts = [("the same leaf names in another order or other containers: build the tree as the one given to "
                  "engine.parallelize")]
    return f" ({'; '.join(parts)})" if parts else ""
