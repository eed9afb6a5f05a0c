"""Packed transfers: the small tensors of one transfer travel as one byte buffer, the large ones alone.

A transfer (one `CommOp`: a stage's activations or input grads for one microbatch) may carry one large
activation and dozens of tiny tensors (BatchNorm's partial statistics on their way to the last stage as
aux leaves, RoPE tables). Each message is one `isend`/`irecv`: on NCCL a kernel on the channel's stream
and some 10-30 us of host work, so fifty 1 KiB tensors cost more than one 64 MiB one. `layout` cuts a
transfer's tensors into messages:

- A tensor of at most `SMALL` bytes joins a *pack*: one uint8 buffer holding the packed tensors' bytes,
  each at an offset rounded up to `ALIGN` bytes, every dtype together (bool and integer tensors too:
  bytes are bytes, and one pack per transfer beats one per dtype). A pack closes before it would pass
  `PACK` bytes, and a pack of one tensor is sent as that tensor.
- A larger tensor is its own message, as before: no copy of a big activation, and no coupling of its
  lifetime to anything else's.

Messages go in the order of their first tensor. Both ends compute the same layout from the same data,
the avals of the *receiving* stage's inputs (`StageInfo.recv_aval`), which every rank holds alike (the
lowered table and stage programs are fingerprint-checked before the first step), so no metadata travels.
A layout is per `CommOp`, never across the ops of a `comm` instruction: the two ends of a channel agree
on each transfer (`assemble.interface` checks it), not on how their programs group transfers into
instructions.

The sender copies its small tensors into the pack with one `torch.cat` of byte views (one kernel); the
receiver receives into one `torch.empty` and hands out views of it (no kernel at all), which keep the
pack alive until the last of them dies: `footprint` holds a received pack's bytes until its last member
is freed.

Why these numbers: `SMALL` = 1 MiB is where a message's fixed cost stops mattering. NVLink moves 1 MiB
in about 5-10 us, the order of a message's fixed cost, while the pack's extra copy of it (read and write
at HBM speed) takes well under a microsecond; past it the copy is a price for no gain, and packing a big
activation would also tie its memory to its small neighbours. `PACK` = 16 MiB bounds what a pack adds:
the sender's copy, and the bytes a received pack keeps alive for its longest-lived member. `ALIGN` = 16
bytes keeps every view as aligned as a fresh allocation for vectorised kernels; inductor-compiled programs
assume 16-byte aligned inputs (they were compiled on warm-up's fresh tensors) and would copy a misaligned
one on every call.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch

import ir

from ..planning.artifacts import StageInfo
from .program import CommOp

SMALL = 1 << 20  # bytes: a tensor this size or smaller travels in a pack
PACK = 16 << 20  # bytes: a pack closes before it would grow past this
ALIGN = 16  # bytes: each packed tensor starts at a multiple of this


@attrs.frozen
class Message:
    """One send/receive of a transfer: `members` (positions in the transfer); a pack when `offsets` are given,
    each member at its byte offset in a uint8 buffer of `nbytes`."""

    members: tuple[int, ...]
    nbytes: int
    offsets: tuple[int, ...] = ()

    @property
    def packed(self) -> bool:
        return bool(self.offsets)


@attrs.frozen
class Layout:
    """A transfer's avals and the messages that carry them, in the order both ends post them."""

    avals: tuple[ir.AbstractValue, ...]
    messages: tuple[Message, ...]

    def send(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers to send, one per message: a large tensor as is (contiguous), a pack as one new buffer."""
        return [_pack(m, self.avals, tensors) if m.packed else tensors[m.members[0]].contiguous()
                for m in self.messages]

    def receive(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the buffers to receive into, one per message; the transfer's tensors, views of them, by position)."""
        bufs: list[torch.Tensor] = []
        out: list[torch.Tensor | None] = [None] * len(self.avals)
        for m in self.messages:
            if m.packed:
                flat = torch.empty(m.nbytes, dtype=torch.uint8, device=device)
                for k, v in zip(m.members, _views(flat, m, self.avals)):
                    out[k] = v
            else:
                a = self.avals[m.members[0]]
                flat = out[m.members[0]] = torch.empty(a.shape, dtype=a.dtype, device=device)
            bufs.append(flat)
        return bufs, out  # type: ignore[return-value]


def layout(avals: Sequence[ir.AbstractValue], *, small: int | None = None, pack: int | None = None) -> Layout:
    """The messages of a transfer of `avals`: large tensors alone, the small ones packed (see the module);
    `small` and `pack` default to `SMALL` and `PACK`."""
    small = SMALL if small is None else small
    pack = PACK if pack is None else pack
    messages: list[Message] = []
    members: list[int] = []
    offsets: list[int] = []
    end = 0

    def close() -> None:
        if len(members) == 1:
            messages.append(Message((members[0],), avals[members[0]].nbytes))
        elif members:
            messages.append(Message(tuple(members), _aligned(end), tuple(offsets)))
        members.clear()
        offsets.clear()

    for k, a in enumerate(avals):
        if a.nbytes > small:
            messages.append(Message((k,), a.nbytes))
            continue
        start = _aligned(end) if members else 0
        if members and start + a.nbytes > pack:
            close()
            start = 0
        members.append(k)
        offsets.append(start)
        end = start + a.nbytes
    close()
    return Layout(tuple(avals), tuple(sorted(messages, key=lambda m: m.members[0])))


class Layouts:
    """Each transfer's layout, made once per (receiving stage, what): both ends derive it from the receiver's avals."""

    RECEIVER = {"act": 1, "grad": -1}  # a send of stage s's outputs goes to stage s + 1, of its input grads to s - 1

    def __init__(self, infos: Sequence[StageInfo]) -> None:
        self.infos = infos
        self.made: dict[tuple[int, str, int], Layout] = {}

    def __call__(self, c: CommOp) -> Layout:
        stage = c.stage if c.op == "recv" else c.stage + self.RECEIVER[c.what]
        key = (stage, c.what, len(c.bufs))
        if key not in self.made:
            self.made[key] = layout([self.infos[stage].recv_aval(c.what, k) for k in range(len(c.bufs))])
        return self.made[key]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _pack(m: Message, avals: Sequence[ir.AbstractValue], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer of `m.nbytes`: each member's bytes at its offset, zeros between (one cat)."""
    parts: list[torch.Tensor] = []
    end = 0
    zeros: torch.Tensor | None = None
    for k, off in zip(m.members, m.offsets):
        t, a = tensors[k], avals[k]
        if t.dtype != a.dtype or t.numel() != a.numel:
            raise RuntimeError(f"internal error: transfer tensor {k} is {t.dtype}{list(t.shape)}, its receiver "
                               f"expects {a.dtype}{list(a.shape)}")
        if off > end:
            zeros = zeros if zeros is not None else torch.zeros(ALIGN, dtype=torch.uint8, device=t.device)
            parts.append(zeros[:off - end])
        parts.append(t.contiguous().reshape(-1).view(torch.uint8))  # expanded or strided values too
        end = off + a.nbytes
    if m.nbytes > end:
        zeros = zeros if zeros is not None else torch.zeros(ALIGN, dtype=torch.uint8, device=parts[-1].device)
        parts.append(zeros[:m.nbytes - end])
    return torch.cat(parts)


def _views(flat: torch.Tensor, m: Message, avals: Sequence[ir.AbstractValue]) -> list[torch.Tensor]:
    """Each member of pack `m` as a contiguous view of `flat`, with its aval's shape and dtype."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for k, off in zip(m.members, m.offsets):
        a = avals[k]
        if a.dtype not in typed:
            typed[a.dtype] = flat.view(a.dtype)  # nbytes is a multiple of ALIGN, so of every itemsize
        out.append(typed[a.dtype].as_strided(a.shape, _strides(a.shape), off // a.dtype.itemsize))
    return out


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))
