"""Stage joints stitched from the joints of their pieces: a stage of N identical layers is differentiated
as one layer, traced once, and copied N times.

Tracing a stage's joint graph (`outputs, vjp(cotangents)` under make_fx with fake tensors) costs about a
millisecond per ATen op, and a planner costs hundreds of candidate stages of a model built from a few
distinct layers. The joint of a composition is the composition of the joints: run the pieces' forward
parts in order, then their backward parts in reverse, each piece's output cotangent the sum of what
the later pieces (and the stage's own cotangent) give back for that value. `stitched_joint` builds that
graph from one traced joint per distinct piece (pieces are keyed by their printed core: the equations
of one block without the values that only pass through it, so the 80 layers of a Llama print alike).

What it equals: the same equations as the joint traced for the whole stage (each op's backward formula
is autograd's, traced once per piece), with the cotangents of a value read by several pieces summed by
explicit adds where autograd sums them too; so the F/B/W partition, the saved values, the kernel times
and the bytes `ir.stage_autodiff` derives from it are the traced joint's. Only the order of independent
equations, and of the terms of a sum of three or more cotangents, may differ; and where a value crossing
between pieces is not contiguous, autograd's choice of formula (an `mm` backward's transposes, a `view` that
needs a copy), which the piece made on a contiguous input: `check_runs` refuses a stitched joint an op fails
on, the rest computes the same numbers (float64 to 1e-16 in the reviews). The planner uses stitched joints to
cost candidate stages, and a plan's stages run them too (engine/planning/artifacts.py `Workshop.running`):
tracing each stage's own joint took 9-13 s of a 0.85 B Llama's 35-42 s warm restart on 2 x H100
(2026-11-27). A stage whose joint is not its pieces' (`NotStitchable`) is traced.
"""
from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import attrs
import torch

from .autodiff import _joint, diff_positions
from .core import Eqn, Graph, Literal, Var
from .slicing import REDETACH, Stage


@attrs.frozen(eq=False)
class Piece:
    """One block of a stage as a graph of its own core: `keys_in[i]` / `keys_out[j]` are the model graph's
    values each core input / output is (a value a block re-detaches stands for the value it detaches)."""

    graph: Graph
    keys_in: tuple[Var, ...]
    keys_out: tuple[Var, ...]
    constant: tuple[int, ...]          # core inputs that are batch leaves (never differentiated)
    constant_outputs: tuple[int, ...]  # core outputs that are the loss function's aux values


def _sources(g: Graph) -> dict[Var, Var]:
    """Each re-detached received value (ir.split) -> the value it detaches."""
    return {e.outputs[0]: e.inputs[0] for e in g.eqns if e.source == REDETACH}  # type: ignore[misc]


def _key(src: dict[Var, Var], v: Any) -> Any:
    return src.get(v, v)


def piece_of(block: Stage) -> Piece:
    """A block's core: its equations (less the re-detaches of received values it only passes on), the inputs
    they read and the outputs they make; values that only pass through the block are left to the stitching."""
    g = block.graph
    used = {v for e in g.eqns for v in e.inputs}
    eqns = tuple(e for e in g.eqns if not (e.source == REDETACH and not set(e.out_vars) & used))
    read = {v for e in eqns for v in e.inputs}
    made = {v for e in eqns for v in e.out_vars}
    n_params, n_batch = len(block.param_ids), len(block.batch_ids)
    ins = [i for i, v in enumerate(g.inputs) if v in read]
    outs = [j for j, v in enumerate(g.outputs) if isinstance(v, Var) and v in made]
    core = Graph(tuple(g.inputs[i] for i in ins), eqns, tuple(g.outputs[j] for j in outs),
                 num_params=sum(1 for i in ins if i < n_params))
    aux = len(block.acts_out) + 1 if block.is_last else len(g.outputs)  # a loss function's aux outputs from here
    src = _sources(g)
    return Piece(core, tuple(g.inputs[i] for i in ins), tuple(_key(src, g.outputs[j]) for j in outs),
                 tuple(k for k, i in enumerate(ins) if n_params <= i < n_params + n_batch),
                 tuple(k for k, j in enumerate(outs) if j >= aux))


def _ancestors(g: Graph, targets: Sequence[Any]) -> set[int]:
    prod = g.producers()
    seen: set[int] = set()
    stack = [prod[v] for v in targets if isinstance(v, Var) and v in prod]
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(prod[v] for v in g.eqns[i].inputs if v in prod)
    return seen


# What tracing `torch.zeros_like(x)` records (the Python binding fills pin_memory in): the stitched joint's
# zeros are the traced joint's equation for equation, so a calibration table keyed by op signature times them
# once for both (without it, every BatchNorm layer's zeros were costed by the roofline on the planner's side:
# ResNet-101x4's backward planned 3.2-3.4 % under its measured program on an H100, 2026-11-26).
ZEROS_LIKE_KWARGS = (("pin_memory", False),)


class NotStitchable(Exception):
    """The stage's joint is not the composition of its pieces' joints: a piece makes a value that nothing the
    stage differentiates reads (an aux value made before the stage's last block), which the traced joint holds
    constant but a piece's joint would differentiate from a zero cotangent (extra work, and 0 x inf = NaN
    where the value's backward divides by it). Trace the stage's own joint instead."""


class _Builder:
    """The stitched graph's equations, with each copied equation's outputs fresh (one piece's joint may be
    copied several times into one stage)."""

    def __init__(self) -> None:
        self.eqns: list[Eqn] = []

    def copy(self, e: Eqn, rename: dict[Var, Any]) -> None:
        fresh = tuple(None if v is None else Var(v.aval) for v in e.outputs)
        rename.update({v: w for v, w in zip(e.outputs, fresh) if v is not None})
        self.eqns.append(attrs.evolve(e.replace_inputs(rename), outputs=fresh))

    def op(self, op: str, *args: Any, kwargs: tuple[tuple[str, Any], ...] = ()) -> Var:
        out = Var(next(a for a in args if isinstance(a, Var)).aval)
        self.eqns.append(Eqn(op, tuple(args), kwargs, (out,)))
        return out

    def accumulate(self, sums: dict[Any, Any], key: Any, term: Any) -> None:
        """Add `term` into the cotangent of `key` as it arrives, as autograd's input buffers do (so the
        partial sums live as long as in the traced joint)."""
        sums[key] = self.op("aten.add.Tensor", sums[key], term) if key in sums else term

    def total(self, sums: dict[Any, Any], key: Any, like: Any) -> Any:
        """The cotangent of `key`; zeros like `like` when nothing reached it."""
        return sums[key] if key in sums else self.op("aten.zeros_like.default", like, kwargs=ZEROS_LIKE_KWARGS)


def _unused_grad(jg: Graph, prod: dict[Var, int], grad: Any, slot: int) -> bool:
    """A piece's grad that is `zeros_like` of its own input: the input does not reach an output."""
    e = jg.eqns[prod[grad]] if isinstance(grad, Var) and grad in prod else None
    return e is not None and e.op == "aten.zeros_like.default" and e.inputs[:1] == (jg.inputs[slot],)


def stitched_joint(stage: Stage, pieces: Sequence[Piece], joints: Sequence[Graph], diff_in: Sequence[int],
                   diff_out: Sequence[int]) -> Graph:
    """The joint graph of `stage` (as `ir.autodiff` traces it: inputs the stage graph's, then a cotangent per
    `diff_out` output; outputs the stage's, then a grad per `diff_in` input) from its consecutive pieces and
    each piece's traced joint (`joints[k]`, differentiated in its own float inputs and outputs except its
    `constant` and `constant_outputs`). NotStitchable where a piece's differentiated output gets no cotangent."""
    g = stage.graph
    src = _sources(g)
    keys_in, keys_out = g.inputs, tuple(_key(src, v) for v in g.outputs)
    ins = tuple(Var(v.aval) for v in g.inputs)
    cts = tuple(Var(g.outputs[j].aval) for j in diff_out)  # type: ignore[union-attr]
    env: dict[Any, Any] = dict(zip(keys_in, ins))
    b = _Builder()
    renames = []
    for piece, jg in zip(pieces, joints):
        n_in, n_out = len(piece.graph.inputs), len(piece.graph.outputs)
        rename: dict[Var, Any] = dict(zip(jg.inputs[:n_in], (env[k] for k in piece.keys_in)))
        forward = _ancestors(jg, jg.outputs[:n_out])
        for i in sorted(forward):
            b.copy(jg.eqns[i], rename)
        env.update((k, rename.get(o, o)) for k, o in zip(piece.keys_out, jg.outputs[:n_out]))
        renames.append((rename, forward))
    redetached = {j for j, v in enumerate(g.outputs) if v in src}
    # a received value the stage only detaches and passes on gets no grad from its cotangent
    sums: dict[Any, Any] = {keys_out[j]: c for j, c in zip(diff_out, cts) if j not in redetached}
    for piece, jg, (rename, forward) in reversed(list(zip(pieces, joints, renames))):
        n_in, n_out = len(piece.graph.inputs), len(piece.graph.outputs)
        p_in, p_out = _diff(piece)
        read = {v for e in jg.eqns for v in e.inputs} | {v for v in jg.outputs if isinstance(v, Var)}
        for c, j in zip(jg.inputs[n_in:], p_out):
            if c in read:
                if piece.keys_out[j] not in sums:
                    raise NotStitchable(f"piece output {piece.keys_out[j]} gets no cotangent")
                rename[c] = sums[piece.keys_out[j]]
        for i, e in enumerate(jg.eqns):
            if i not in forward:
                b.copy(e, rename)
        prod = jg.producers()
        for grad, i in zip(jg.outputs[n_out:], p_in):
            if not _unused_grad(jg, prod, grad, i):
                b.accumulate(sums, piece.keys_in[i], rename.get(grad, grad))
    outs = tuple(v if isinstance(v, Literal) else env[k] for k, v in zip(keys_out, g.outputs))
    grads = tuple(b.total(sums, keys_in[i], ins[i]) for i in diff_in)
    return Graph(ins + cts, tuple(b.eqns), outs + grads, input_names=tuple(f"in{i}" for i in range(len(ins) + len(cts))))


def check_runs(joint: Graph, device: str | None = None) -> Graph:
    """`joint`, after running it on fake tensors (shapes and strides only, contiguous inputs on `device` as the
    runtime gives a stage): NotStitchable if an op refuses. Each piece was traced on contiguous inputs and
    cotangents, but in the stage a piece may get a transposed view from the piece before (or its cotangent from
    the one after), and a traced `view` of it fails (a Hugging Face Llama's attention cut at its modules,
    2026-11-27); the stage's own traced joint saw the real strides. A joint for a device this machine lacks (a
    plan for GPUs made on a CPU-only one) is checked on the meta device, whose kernels compute the same shapes
    and strides, so it builds the programs the device's own machine builds."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .device import available, device_type, retarget
    from .evaluate import interpret

    target, runnable = device or "cpu", joint
    if not available(target):
        target, runnable = "meta", retarget(joint, device_type(target), "meta")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = [torch.empty(tuple(v.aval.shape), dtype=v.aval.dtype, device=target) for v in runnable.inputs]
            interpret(runnable, args)
    except Exception as err:  # noqa: BLE001 -- any refusal: the traced joint is the safe program
        raise NotStitchable(f"the stitched joint does not run on the stage's strides: {err}") from err
    return joint


def _diff(piece: Piece) -> tuple[list[int], list[int]]:
    return diff_positions(piece.graph, piece.constant, piece.constant_outputs)  # stage autodiff's rule


def piece_joint(piece: Piece, device: str | None, joints: MutableMapping[Any, Graph] | None) -> Graph:
    """The traced joint of one piece (through the cache `joints`, keyed by the piece's printed core)."""
    diff_in, diff_out = _diff(piece)
    return _joint(piece.graph, diff_in, diff_out, device, joints)
