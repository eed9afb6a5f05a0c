"""`ir.trace`: turn a pure loss function over pytrees into an ir.Graph, with fake tensors only."""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from .core import Graph
from .dtype_rules import DtypeError, check_dtypes
from .dtype_rules import locate as locate_dtypes
from .errors import TraceError
from .functional import exporting, free_layouts, functionalized
from .fx_import import FxImporter
from .grad_mode import stop_gradients
from .purify import NeedsFunctionalization, reject_rng, remove_mutation
from .sink import sink_input_ops
from .static_index import static_mask_indices
from .trace_errors import (
    ImpureError,
    explain,
    locate,
    not_a_function,
    raised_at,
)

# torch logs every failing fake op with a traceback of its own; the TraceError says what it means
_TORCH_LOGGERS = ("torch._subclasses.fake_tensor",)


@attrs.frozen
class TensorSpec:
    """Shape and dtype of a leaf, standing in for a tensor that need not exist (like jax.ShapeDtypeStruct)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: str | None = None


def key_name(path: Sequence[Any]) -> str:
    """`blocks.3.w_q` for the key path of a pytree leaf."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def leaf_names(fn: Callable, params: Any, batch: Sequence[Any]) -> list[str]:
    """Params leaves by key path; batch leaves by the function's argument names (`x`, `y.mask`)."""
    try:
        argnames = list(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        argnames = []
    names = [key_name(p) or "params" for p, _ in pytree.tree_flatten_with_path(params)[0]]
    for i, arg in enumerate(batch):
        base = argnames[i] if i < len(argnames) else f"arg{i + 1}"
        for p, _ in pytree.tree_flatten_with_path(arg)[0]:
            names.append(".".join(x for x in (base, key_name(p)) if x))
    return names


def _fake_leaf(x: Any, mode: FakeTensorMode, device: str | None, name: str) -> FakeTensor:
    if isinstance(x, TensorSpec):
        with mode:
            return torch.empty(x.shape, dtype=x.dtype, device=device or x.device or "cpu")
    if not isinstance(x, torch.Tensor):
        raise TraceError(f"leaf '{name}' is a {type(x).__name__}; params and batch leaves must be tensors "
                         "(or ir.TensorSpec); pass Python constants by closing over them")
    target = device or ("cpu" if x.device.type == "meta" else str(x.device))
    with mode:
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()) if x.is_contiguous() else
                                   torch.empty(x.shape).stride(), dtype=x.dtype, device=target)


def _user_line(exc: BaseException) -> str:
    return raised_at(exc)


@contextlib.contextmanager
def _quiet(names: Sequence[str]) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _anchor(fn: Callable) -> None:
    """Let make_fx's stack traces keep the frames of `fn` and of the functions beside it in its file: by default
    they keep only modules' `forward` frames, so a plain loss function's ops had no line."""
    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)  # private, in torch 2.13
    fn = getattr(fn, "func", fn)  # functools.partial
    code = getattr(fn, "__code__", None)
    if register is None or code is None:
        return
    register(fn)
    for other in list(getattr(fn, "__globals__", {}).values()):
        if getattr(getattr(other, "__code__", None), "co_filename", None) == code.co_filename:
            register(other)


def _make_fx(flat_fn: Callable, leaves: list[FakeTensor], names: Sequence[str], functional: bool,
             stacks: bool = False) -> torch.fx.GraphModule:
    kwargs: dict[str, Any] = {"tracing_mode": "fake", "pre_dispatch": True}
    if stacks and "record_stack_traces" in inspect.signature(make_fx).parameters:
        kwargs["record_stack_traces"] = True
    gm = make_fx(functionalized(flat_fn, names) if functional else flat_fn, **kwargs)(*leaves)
    gm.graph.eliminate_dead_code()  # the views functionalization regenerates after a write, unread
    return gm


def _graph(gm: torch.fx.GraphModule, names: Sequence[str], num_params: int, in_tree: Any, out_tree: Any,
           functional: bool) -> Graph:
    imp = FxImporter(gm).run()
    g = Graph(tuple(imp.inputs), tuple(imp.eqns), imp.outputs, tuple(names), num_params, in_tree, out_tree)
    g = static_mask_indices(stop_gradients(g, imp.frozen))
    g = sink_input_ops(reject_rng(remove_mutation(free_layouts(g) if functional else g)))
    check_dtypes(g)  # what the meta kernels let through and the real ones refuse
    return g


def trace(fn: Callable, params: Any, *batch: Any, device: str | torch.device | None = None,
          lines: bool = False) -> Graph:
    """Trace `fn(params, *batch)` into a pure ATen-level graph; no real weights are needed.

    Leaves may be real tensors, meta tensors, fake tensors or `TensorSpec`s; `device` (default: each
    leaf's own, with meta read as cpu) is the device the graph will run on, so its ops and factory
    calls target it. Attention stays one `scaled_dot_product_attention` op.

    A function whose in-place ops only rewrite fresh values is traced as written (each becomes its
    out-of-place form); one that writes through a view whose base or other views are read later (slice
    assignment, `copy_` into a view, T5's `_shift_right`) is traced again through PyTorch's
    functionalization (ir.functional). Writes into params or batch are refused either way.

    Source lines (make_fx's stack traces: about 40 % of a trace's time) are recorded only when a trace
    fails: it runs again with them, so the error names the user's line; `lines=True` records them anyway
    (each Eqn's `source`), for a pass that names an op's line.
    """
    problem = not_a_function(fn, "ir.trace")
    if problem:
        raise TraceError(problem)
    device = str(device) if device is not None else None
    flat, in_tree = pytree.tree_flatten((params, *batch))
    names = leaf_names(fn, params, batch)
    num_params = len(pytree.tree_leaves(params))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    leaves = [_fake_leaf(x, mode, device, n) for x, n in zip(flat, names)]
    out_tree: list[pytree.TreeSpec] = []

    def flat_fn(*xs: Any) -> list[Any]:
        p, *b = pytree.tree_unflatten(list(xs), in_tree)
        out, spec = pytree.tree_flatten(fn(p, *b))
        out_tree.append(spec)
        return out

    def attempt(functional: bool, stacks: bool) -> Graph:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_quiet(_TORCH_LOGGERS))
            stack.enter_context(mode)
            stack.enter_context(exporting())
            gm = _make_fx(flat_fn, leaves, names, functional, stacks)
        return _graph(gm, names, num_params, in_tree, out_tree[-1], functional)

    def traced(stacks: bool) -> Graph:
        try:
            return attempt(False, stacks)  # the graph as written: in-place ops on fresh values rewritten
        except NeedsFunctionalization:  # a write through a view: PyTorch's functionalization replays it
            return attempt(True, stacks)

    if lines:
        _anchor(fn)
    try:
        try:
            return traced(stacks=lines)
        except Exception:  # noqa: BLE001 - the same trace with source lines, for the error to name them
            return traced(stacks=True)
    except DtypeError as err:  # run the function once more to find the line that mixed them
        with _quiet(_TORCH_LOGGERS), mode:
            raise err.located(locate_dtypes(lambda: flat_fn(*leaves))) from None
    except ImpureError as err:  # run the function once more to find the line that drew or wrote
        with _quiet(_TORCH_LOGGERS), mode:
            at, op = locate(err.kind, lambda: flat_fn(*leaves), leaves)
        raise err.located(at, op) from None
    except TraceError:
        raise
    except Exception as exc:  # torch raises many types; explain() tells the causes apart
        raise TraceError(explain(getattr(fn, "__name__", repr(fn)), exc, _user_line(exc))) from exc
