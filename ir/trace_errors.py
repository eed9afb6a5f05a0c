"""What a trace failure means: one message per cause, each with that cause's fix only, and its source line."""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import TraceError

# frames that are never the user's: torch's, the IR's and the engine's (engine.functionalize's wrapper)
_NOT_USER = tuple(os.path.join(d, "") for d in (os.path.dirname(torch.__file__), os.path.dirname(__file__),
                                               os.path.join(os.path.dirname(os.path.dirname(__file__)), "engine")))

RNG = ("{op} draws from PyTorch's global random state{where}\n"
       "Dropout, DropPath (stochastic depth), torch.rand* and bernoulli_ all do, so the graph would not be a "
       "pure function: every microbatch, rank and replay would draw different numbers.\n"
       "Fix: pass the randomness in. For dropout, run the model under `with ir.keyed_dropout(keys):` with keys = ir.row_keys(seed, "
       "batch_size) a batch argument (engine.functionalize(model, rng=True) does this), so each row's mask is "
       "keyed and the pipeline equals one process; for other draws pass the randomness in: a mask "
       "`ir.random.uniform(key, shape) >= p` with `key` an int64 tensor in the batch; or switch it off "
       "(model.eval(), F.dropout(..., training=False), drop_path_rate=0).")

INPUT_WRITE = ("{op} mutates input '{name}' in place{where}\n"
               "The loss function must be pure: it is traced once and replayed for every microbatch and rank, "
               "so a write into params or the batch would not happen once per step.\n"
               "Fix: compute a new tensor (`w = w + 1`, not `w.add_(1)`; torch.where or index_put instead of "
               "`w[i] = v`), and update params outside the loss (engine.optim).")

CONTROL_FLOW = ("cannot trace {fn}: Python reads a tensor's value ({op}){where}\n"
                "fnpipe traces shapes, not values, so Python cannot branch on or compute with the data inside "
                "the loss: `if t > 0`, `bool(t)`, `assert t.all()`, `.item()`, `.tolist()`.\n"
                "Fix: keep the choice in tensor ops (torch.where(cond, a, b), a mask, clamp) instead of `if` / "
                "`.item()` / `.tolist()`, or compute the Python value outside the loss function and close over it.")

DYNAMIC_SHAPE = ("cannot trace {fn}: {op} makes a tensor whose shape depends on the data{where}\n"
                 "`x[mask]`, nonzero, masked_select, unique and repeat_interleave by a tensor do; a pipeline "
                 "must know every shape before the step runs.\n"
                 "Fix: keep shapes fixed: weight by the mask instead of selecting (`(h * mask).sum() / "
                 "mask.sum()` for a masked mean, torch.where(mask, h, 0)), or pad to a fixed size.")

FUNCTION_RAISED = ("cannot trace {fn}: it raised {kind}: {text}{where}\n"
                   "This is an error in the function itself for inputs of these shapes and dtypes (tracing "
                   "runs it once on fake tensors: shapes, no values).\n"
                   "Fix: that line; calling the function on real tensors of the same shapes shows the same "
                   "error with a full traceback.")

NOT_A_FUNCTION = ("{entry} takes a pure function fn(params, *batch) -> loss and its params, not an "
                  "nn.Module ({kind}). Make one from the module with engine.functionalize:\n"
                  "    fn, variables = engine.functionalize(model, loss=F.cross_entropy)\n"
                  "    {call}(fn, variables, x, y, ...)\n"
                  "(leaves named params.<module path> and buffers.<module path>).")


MOE = ("This is mixture-of-experts routing: gathering each expert's tokens (top-k with a data-dependent token "
       "count per expert) cannot be a static pipeline.\n"
       "Fix: route with fixed shapes: transformers' MoE models run every token's top-k experts on gathered "
       "weights with `model.set_experts_implementation(\"batched_mm\")` (or from_pretrained(..., "
       "experts_implementation=\"batched_mm\")); in your own layer run every expert on every token and weight "
       "by the gates (zero for unselected experts), or use a fixed expert capacity.")

#: words in the failing line's file or function -> what that construct is and its way out
_CONSTRUCTS = {("moe", "expert"): MOE}


def _construct(at: str) -> str | None:
    low = at.lower()
    return next((hint for words, hint in _CONSTRUCTS.items() if any(w in low for w in words)), None)


def raised_at(exc: BaseException) -> str:
    """Where tracing raised: the innermost line outside torch and fnpipe, and the user's own line that
    called it when that one is in a library (transformers' modeling file, called from the loss)."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner, own = frame_line(frames, libraries=True), frame_line(frames)
    return inner if own in ("", inner) else f"{inner}\n  called from {own}"


def _where(at: str) -> str:
    return f"\n  at {at}" if at else ""


class ImpureError(TraceError):
    """The traced graph draws from the global RNG (`kind` "rng") or writes into an input ("write");
    `ir.trace` finds the source line and raises it again with `located(line)`."""

    def __init__(self, kind: str, op: str, name: str = "", at: str = "") -> None:
        self.kind, self.op, self.name = kind, op, name
        template = RNG if kind == "rng" else INPUT_WRITE
        super().__init__(template.format(op=op, name=name, where=_where(at)))

    def located(self, at: str, op: str = "") -> ImpureError:
        """The same error at source line `at`, naming `op` (the op as the function called it, before
        functionalization renamed it: `bernoulli_.float` for `bernoulli.p`) when it is that op."""
        same = op and (self.kind == "write" or _base(op) == _base(self.op))
        return ImpureError(self.kind, op if same else self.op, self.name, at)


def _base(op: str) -> str:
    parts = op.split(".")
    return parts[1].rstrip("_") if len(parts) > 2 else op


def frame_line(frames: Sequence[traceback.FrameSummary], *, libraries: bool = False) -> str:
    """`file:line in function: code` of the innermost frame outside torch and fnpipe (and, unless
    `libraries`, outside site-packages), or "" when there is none."""
    for fr in reversed(frames):  # `<string>`: code that torch or a library generated
        if fr.filename.startswith(_NOT_USER) or fr.filename.startswith("<") or \
                (not libraries and "site-packages" in fr.filename):
            continue
        return f"{fr.filename}:{fr.lineno} in {fr.name}: {fr.line}"
    return ""


class _Stop(Exception):
    def __init__(self, op: str) -> None:
        super().__init__(op)
        self.op = op


def _draws(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" in names:  # attention draws only with dropout
        i = names.index("dropout_p")
        return (kwargs.get("dropout_p") if i >= len(args) else args[i]) not in (None, 0, 0.0)
    return True


class _Finder(TorchDispatchMode):
    """Stops at the first op that draws random numbers ("rng") or writes into an input ("write")."""

    def __init__(self, kind: str, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.kind = kind
        self.storages = {StorageWeakRef(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)}

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.kind == "rng" and _draws(func, args, kwargs):
            raise _Stop(str(func))
        if self.kind == "write":
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    t = args[i] if i < len(args) else kwargs.get(a.name)
                    if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) in self.storages:
                        raise _Stop(str(func))
        return func(*args, **kwargs)


def locate(kind: str, run: Callable[[], Any], inputs: Sequence[torch.Tensor]) -> tuple[str, str]:
    """Where `run()` (the traced function, on fake inputs, under their fake mode) first draws random
    numbers or writes into `inputs`, and the op that does: the innermost line outside torch, and the
    user's own line when that one is in a library (timm's drop_path, called from the loss function);
    ("", "") when it is not found."""
    try:
        with _Finder(kind, inputs):
            run()
    except _Stop as stop:
        frames = traceback.extract_tb(stop.__traceback__)
        inner, own = frame_line(frames, libraries=True), frame_line(frames)
        return (inner if own in ("", inner) else f"{inner}\n  called from {own}"), stop.op
    except Exception:  # noqa: BLE001 -- only a hint: the message stands without a line
        return "", ""
    return "", ""


def explain(fn_name: str, exc: BaseException, at: str) -> str:
    """The TraceError message for an exception raised while tracing `fn_name` (`at`: the user's line)."""
    op = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, DataDependentOutputException):
        return CONTROL_FLOW.format(fn=fn_name, op=op, where=_where(at))
    if isinstance(exc, GuardOnDataDependentSymNode):
        return CONTROL_FLOW.format(fn=fn_name, op="a data-dependent value", where=_where(at))
    if isinstance(exc, DynamicOutputShapeException):
        text = DYNAMIC_SHAPE.format(fn=fn_name, op=op, where=_where(at))
        construct = _construct(at)
        return text if construct is None else text.split("\n")[0] + _where(at) + "\n" + construct
    return FUNCTION_RAISED.format(fn=fn_name, kind=type(exc).__name__, text=op, where=_where(at))


def not_a_function(obj: Any, entry: str) -> str | None:
    """The message for an `nn.Module` given where a pure function is expected (None for a function)."""
    if not isinstance(obj, torch.nn.Module):
        return None
    return NOT_A_FUNCTION.format(entry=entry, kind=type(obj).__name__, call=entry)
