"""Instructions of a per-rank program: small frozen values that print as a listing and round-trip JSON.

Operands are references: `b12` a buffer, `p3` parameter leaf 3, `x4` batch leaf 4 of the current
microbatch, `g3` the gradient accumulator of leaf 3, `_` nothing.
"""
from __future__ import annotations

import json

import attrs

from ..planning.plan import fingerprint  # noqa: F401 -- re-exported: programs are fingerprinted too

COMPUTE = ("forward", "backward_input", "backward_weight", "backward")
SHORT = {"forward": "F", "backward_input": "B", "backward_weight": "W", "backward": "BW"}  # as schedule actions


def format_refs(refs: tuple[str, ...]) -> str:
    """`p0 p1 p2 x5 b7` prints as `p0..p2 x5 b7`: runs of consecutive refs of one kind are folded."""
    out: list[str] = []
    run: list[str] = []
    for ref in refs:
        if run and ref[0] == run[-1][0] and ref[1:].isdigit() and run[-1][1:].isdigit() \
                and int(ref[1:]) == int(run[-1][1:]) + 1:
            run.append(ref)
            continue
        out.append(_fold(run))
        run = [ref]
    out.append(_fold(run))
    return " ".join(x for x in out if x)


def _fold(run: list[str]) -> str:
    return " ".join(run) if len(run) < 3 else f"{run[0]}..{run[-1]}"


@attrs.frozen
class CommOp:
    """One point-to-point transfer inside a group: `send` or `recv` of buffers for (stage, mb)."""

    op: str  # "send" | "recv"
    what: str  # "act" | "grad"
    stage: int
    mb: int
    peer: int  # world rank
    bufs: tuple[str, ...]

    def __str__(self) -> str:
        arrow = "to" if self.op == "send" else "from"
        return f"{self.op}_{self.what} s{self.stage} mb{self.mb} {arrow} r{self.peer} [{format_refs(self.bufs)}]"


@attrs.frozen
class Instr:
    """`kind` selects the handler; `stage`/`mb` say whose work it is; `reads`/`writes` are refs."""

    kind: str
    stage: int = -1
    mb: int = -1
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    comm: tuple[CommOp, ...] = ()
    group: tuple[int, ...] = ()

    def accumulated(self) -> tuple[int, ...]:
        """Positions of this compute's outputs that add into grad accumulators (`g<leaf>` refs)."""
        return tuple(k for k, ref in enumerate(self.writes) if ref[0] == "g")

    def __str__(self) -> str:
        if self.kind == "comm":
            return "comm { " + "; ".join(map(str, self.comm)) + " }"
        head = self.kind + (f" s{self.stage}" if self.stage >= 0 else "") + (f" mb{self.mb}" if self.mb >= 0 else "")
        grp = f" group={list(self.group)}" if self.group else ""
        outs = f" -> [{format_refs(self.writes)}]" if self.writes else ""
        return f"{head}{grp} [{format_refs(self.reads)}]{outs}"


@attrs.frozen
class Program:
    """The static instruction list of one world rank."""

    rank: int
    instrs: tuple[Instr, ...]

    def __str__(self) -> str:
        lines = [f"program rank {self.rank} ({len(self.instrs)} instructions)"]
        lines += [f"  {i:4d}: {ins}" for i, ins in enumerate(self.instrs)]
        return "\n".join(lines)

    def to_json(self) -> str:
        """`attrs.asdict(self)` as JSON, written out by hand: asdict's generic walk took 28 ms of a
        program's 32 ms at 400 instructions, and a 1,024-rank check fingerprints every program."""
        return json.dumps({"rank": self.rank, "instrs": [_instr_dict(i) for i in self.instrs]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Program:
        d = json.loads(text)
        instrs = []
        for i in d["instrs"]:
            comm = tuple(CommOp(**{**c, "bufs": tuple(c["bufs"])}) for c in i["comm"])
            instrs.append(Instr(i["kind"], i["stage"], i["mb"], tuple(i["reads"]), tuple(i["writes"]), comm,
                                tuple(i["group"])))
        return cls(d["rank"], tuple(instrs))


def _instr_dict(i: Instr) -> dict:
    comm = [{"op": c.op, "what": c.what, "stage": c.stage, "mb": c.mb, "peer": c.peer, "bufs": list(c.bufs)}
            for c in i.comm]
    return {"kind": i.kind, "stage": i.stage, "mb": i.mb, "reads": list(i.reads), "writes": list(i.writes),
            "comm": comm, "group": list(i.group)}
