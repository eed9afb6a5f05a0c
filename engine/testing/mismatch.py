"""Comparing a parallel run's loss and grads with `torch.func.grad`, and the failure report.

Tolerances per dtype (relative to the largest magnitude of the expected leaf):

    float64  1e-10   (observed ~1e-15: only the order of the microbatch sums differs)
    float32  1e-5    (observed ~1e-7)
    float16  2e-3
    bfloat16 2e-2    (8 mantissa bits; microbatch partial sums round differently)

A leaf passes when `max|actual - expected| <= atol + rtol * max|expected|`. The default `atol` is
`rtol * scale`, `scale` being the largest expected magnitude over all grad leaves (the loss is compared
on its own): a grad that is zero in exact arithmetic (a bias before a layer norm, the query weights of
attention over one token) is rounding noise in both runs, and noise far below the model's grad scale
is not a mismatch. A leaf's reported relative error is `max abs err / (max|expected| + atol / rtol)`, so
it passes exactly when that is at most `rtol`.

Non-finite values follow `torch.allclose(..., equal_nan=True)`: NaN where the reference has NaN, and an
infinity where it has the same infinity, are equal; any other pairing with a NaN or an infinity is an
infinite error. Scales are taken over finite values only. A leaf with no elements always passes (it has
nothing to differ in), and counts as scale 0.
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

__all__ = ["RTOL", "LeafDiff", "ParallelDeadlock", "ParallelMismatch", "compare_leaves", "default_rtol",
           "format_failure", "headline"]

RTOL: dict[torch.dtype, float] = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3,
                                  torch.bfloat16: 2e-2}
PROGRAM_HEAD, PROGRAM_TAIL = 60, 15  # lines of each rank's listing kept in a failure report
SHOWN_VALUES = 6


class ParallelMismatch(AssertionError):
    """The pipelined step's loss or grads differ from `torch.func.grad(fn)` (or its run failed)."""


class ParallelDeadlock(ParallelMismatch):
    """The ranks' programs cannot finish: every rank waits on another (or a wait timed out)."""


def default_rtol(dtype: torch.dtype) -> float:
    return RTOL.get(dtype, 1e-5)


@attrs.frozen
class LeafDiff:
    """How one leaf (or the loss) compares: worst absolute error, where, and relative to the leaf's scale."""

    name: str
    max_abs: float
    rel: float
    tol: float
    index: tuple[int, ...]
    expected: tuple[float, ...]
    actual: tuple[float, ...]
    dtype: torch.dtype
    missing: bool = False

    @property
    def ok(self) -> bool:
        return not self.missing and self.max_abs <= self.tol

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        if self.missing:
            return f"'{self.name}': the parallel run returned no grad, torch.func.grad has max |g| {self.max_abs:.3g}"
        head = (f"'{self.name}' ({dt}): max abs err {self.max_abs:.3e} at index {list(self.index)}, relative "
                f"{self.rel:.3e}; tolerance {self.tol:.3e} (atol + rtol * max|expected|)")
        vals = lambda xs: "[" + ", ".join(f"{x:.6g}" for x in xs) + "]"  # noqa: E731
        return f"{head}\n    expected {vals(self.expected)}\n    actual   {vals(self.actual)}"


def _diff(name: str, actual: torch.Tensor | None, expected: torch.Tensor, rtol: float, atol: float) -> LeafDiff:
    e = expected.detach().to("cpu", torch.float64).reshape(-1)
    scale = _finite_max(e)
    if actual is None:
        return LeafDiff(name, scale, 1.0 if scale else 0.0, atol, (), (), (), expected.dtype, missing=scale > 0)
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    if a.shape != e.shape:
        return LeafDiff(name, float("inf"), float("inf"), 0.0, (), (), (), expected.dtype, missing=True)
    ref = scale + (atol / rtol if rtol > 0 else 0.0)  # what the tolerance is relative to: rel <= rtol passes
    if not e.numel():  # an empty leaf has nothing to differ in
        return LeafDiff(name, 0.0, 0.0, atol + rtol * scale, (), (), (), expected.dtype)
    err = _errors(a, e)
    k = int(err.argmax())
    max_abs = err[k].item()
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(k), expected.shape)) if expected.dim() else ()
    lo = max(0, min(k - SHOWN_VALUES // 2, e.numel() - SHOWN_VALUES))
    return LeafDiff(name, max_abs, max_abs / ref if ref else max_abs, atol + rtol * scale, idx,
                    tuple(e[lo:lo + SHOWN_VALUES].tolist()), tuple(a[lo:lo + SHOWN_VALUES].tolist()), expected.dtype)


def _finite_max(e: torch.Tensor) -> float:
    """The largest finite magnitude (0 for an empty or all-non-finite leaf): the leaf's scale."""
    finite = e[torch.isfinite(e)]
    return finite.abs().max().item() if finite.numel() else 0.0


def _errors(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """|a - e| per element, with equal_nan semantics: NaN against NaN and an infinity against the same
    infinity are no error; NaN against a number, or a number against NaN or an infinity, is an infinite one."""
    err = (a - e).abs()
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    return torch.where(same, torch.zeros_like(err), torch.nan_to_num(err, nan=float("inf"), posinf=float("inf")))


def _plain(x: torch.Tensor) -> torch.Tensor:
    """`x` with storage: autograd returns some all-zero grads (`sgn`'s, of a real input) as efficient zero
    tensors, which have none to read."""
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device) if x._is_zerotensor() else x


def compare_leaves(names: Sequence[str], actual: Sequence[torch.Tensor | None], expected: Sequence[torch.Tensor], *,
                   rtol: float | None, atol: float | None) -> list[LeafDiff]:
    """One LeafDiff per leaf; `actual[i] is None` means the parallel run gave no grad for leaf i."""
    expected = [_plain(x) for x in expected]
    actual = [None if x is None else _plain(x) for x in actual]
    scale = max([_finite_max(x.detach().to("cpu", torch.float64)) for x in expected] or [0.0])
    out = []
    for name, a, e in zip(names, actual, expected):
        r = default_rtol(e.dtype) if rtol is None else rtol
        out.append(_diff(name, a, e, r, r * scale if atol is None else atol))
    return out


def _listing(program: Any) -> str:
    lines = str(program).splitlines()
    if len(lines) <= PROGRAM_HEAD + PROGRAM_TAIL + 1:
        return "\n".join(lines)
    cut = len(lines) - PROGRAM_HEAD - PROGRAM_TAIL
    return "\n".join([*lines[:PROGRAM_HEAD], f"  ... {cut} instructions omitted ...", *lines[-PROGRAM_TAIL:]])


def headline(loss: LeafDiff, grads: Sequence[LeafDiff]) -> str:
    """What differs from `torch.func.grad_and_value(fn)`: the loss, how many grad leaves, or nothing ('')."""
    bad = sum(not d.ok for d in grads)
    what = " and ".join(([] if loss.ok else ["the loss"]) + ([f"grads ({bad} of {len(grads)} leaves)"] if bad else []))
    return f"{what} differ from torch.func.grad_and_value(fn) on the full batch" if what else ""


def format_failure(headline: str, *, description: str | None, spec: Any, plan: Any, programs: Sequence[Any],
                   loss: LeafDiff | None = None, grads: Sequence[LeafDiff] = ()) -> str:
    """The report: what differs, the model, the plan, the schedule, and every rank's program listing."""
    parts = [headline]
    if loss is not None and not loss.ok:
        parts.append(f"loss: expected {loss.expected[0]:.10g}, actual {loss.actual[0]:.10g}, relative error "
                     f"{loss.rel:.3e}, tolerance {loss.tol:.3e}")
    bad = [d for d in grads if not d.ok]
    if bad:
        parts.append(f"first differing leaf {bad[0].describe()}")
        parts.append("differing leaves (relative error): "
                     + ", ".join(f"{d.name} ({'missing' if d.missing else f'{d.rel:.1e}'})" for d in bad[:12])
                     + (f" and {len(bad) - 12} more" if len(bad) > 12 else ""))
    if description:
        parts.append(f"model: {description}")
    if spec is not None:
        parts.append(f"plan spec: {spec}")
    if plan is not None:
        parts.append(f"plan:\n{plan}")
        try:
            parts.append(f"schedule table (as the schedule function returns it):\n{plan.table().to_grid(crop=True)}")
        except Exception as exc:  # noqa: BLE001 -- the report must not hide the mismatch behind a print error
            parts.append(f"schedule table: cannot build ({exc})")
    parts += [_listing(p) for p in programs]
    return "\n".join(parts)
