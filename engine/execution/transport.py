"""Transports the runtime talks through: torch.distributed (NCCL/gloo) and an in-process hub.

Both give the same semantics: `post` starts a group of sends and receives together (like
`batch_isend_irecv`), `wait` blocks on one of them with a timeout, and `all_reduce` sums over a
group of world ranks. Every wait is bounded, so a dead or hung peer becomes an exception.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
import json
import sys
import threading
import os
import socket
import time
import uuid
import weakref
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, PlanError
from . import copies as copying
from . import gates as gating

log = logging.getLogger("engine.launch")
_OPEN: "weakref.WeakSet[DistTransport]" = weakref.WeakSet()  # what close_all closes at exit


class Transport(Protocol):
    rank: int
    world_size: int

    def post(self, ops: Sequence[tuple[str, int, torch.Tensor]], *, pooled: bool = False) -> list[Any]: ...
    def receiving(self, peer: int) -> contextlib.AbstractContextManager[None]: ...
    def prepare(self, receives: dict[int, int]) -> None: ...
    def resident_bytes(self, rank: int) -> int: ...
    def settle(self, what: str) -> None: ...
    def wait(self, handle: Any, what: str) -> None: ...
    def all_reduce(self, t: torch.Tensor, group: tuple[int, ...]) -> None: ...
    def all_gather_json(self, obj: Any) -> list[Any]: ...
    def gather_after_compile(self, obj: Any) -> list[Any]: ...
    def close(self) -> None: ...
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


# How long a rank waits for the others to finish compiling their stage programs (the first gather after
# them), or for rank 0 to calibrate the model's ops (`broadcast_after_local_work`); the environment variable
# FNPIPE_COMPILE_WAIT, in seconds, overrides it. Compiles and calibration are local and may differ by minutes
# between ranks (a cold inductor cache; a ResNet's hundreds of convolution shapes), so these waits get their
# own bound, on a gloo group of their own (an NCCL job needs gloo to connect between its hosts too), not the
# step's timeout.
COMPILE_WAIT = 1800.0


def compile_wait(timeout: float) -> float:
    """The bound of the wait after compiling: FNPIPE_COMPILE_WAIT or COMPILE_WAIT, at least `timeout`."""
    text = os.environ.get("FNPIPE_COMPILE_WAIT")
    try:
        wait = COMPILE_WAIT if text is None else float(text)
    except ValueError:
        wait = -1.0
    if not wait > 0:
        raise PlanError(f"FNPIPE_COMPILE_WAIT={text!r}: give the seconds a rank may wait for the others to "
                        "compile their stage programs, a positive number (e.g. FNPIPE_COMPILE_WAIT=3600)")
    return max(timeout, wait)

# torch 2.13 renamed them (the old names warn); 2.11 has only the old
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DistTransport:
    """torch.distributed: P2P over one-way channels, sums through cached subgroups.

    Each ordered pair of ranks (a -> b) that exchanges tensors gets a communicator of its own that
    carries only a -> b messages. On NCCL every communicator has its own stream, so a channel is a FIFO:
    a send never blocks compute or the opposite direction, and no grouping of sends and receives
    (whose asymmetric batching NCCL may hang on) is needed. Channels connect at start-up, in one
    global order, so their lazy rendezvous cannot interleave with a step. On NCCL, a channel within
    one host is then gated (`gates`): its receives reach the GPU only when their data is ready. With
    FNPIPE_P2P=copy, `prepare` (called by each Step with the largest message it receives from each peer) gives the
    channels within one host copy-engine rings (`copies`): a message that fits a slot crosses by the copy
    engine, one that does not through the channel's communicator. Receive buffers for `post(..., pooled=True)`
    are made inside `receiving(peer)`.
    """

    def __init__(self, timeout: float, groups: Sequence[tuple[int, ...]] = (),
                 channels: Sequence[tuple[int, int]] = (), device: torch.device | None = None) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout
        self.nccl = dist.get_backend() == "nccl"
        td = datetime.timedelta(seconds=timeout)
        everyone = tuple(range(self.world_size))
        # The whole world gets a group of its own too: the default group may carry someone else's timeout.
        self.groups: dict[tuple[int, ...], Any] = {everyone: dist.new_group(list(everyone), timeout=td)}
        self.patience = compile_wait(timeout)
        self.patient = dist.new_group(list(everyone), timeout=datetime.timedelta(seconds=self.patience),
                                      backend="gloo")  # gather_after_compile's
        for g in sorted(set(groups)):  # new_group is collective: every rank creates every group, in order
            if g not in self.groups:
                self.groups[g] = dist.new_group(list(g), timeout=td)
        self.channels: dict[tuple[int, int], Any] = {}
        for a, b in sorted(set(channels)):
            self.channels[(a, b)] = dist.new_group(sorted((a, b)), timeout=td)
        self.device = device if device is not None and self.nccl else torch.device("cpu")
        _OPEN.add(self)
        self.gates: gating.Gates | None = None
        self.copies: copying.Copies | None = None
        self.prepared = False  # `prepare` ran (it is collective only the first time, on every rank alike)
        self.rings: dict[int, int] = {}  # world rank -> bytes of its copy-engine rings (held while the transport is)
        self._connect(self.device)
        self.gates = self._open_gates()

    def _connect(self, device: torch.device) -> None:
        """One small message down every channel this rank is on, in the same order on all ranks."""
        probe = torch.zeros(1, device=device)
        for (a, b), _ in sorted(self.channels.items()):
            if self.rank == a:
                self.wait(self.post([("send", b, probe)])[0], f"connecting to rank {b}")
            elif self.rank == b:
                self.wait(self.post([("recv", a, probe)])[0], f"connecting to rank {a}")

    def _open_gates(self, driver: gating.Driver | None = None) -> gating.Gates | None:
        """Gate the channels whose two ends share a host and both ask for it (`gates.wanted`, NCCL on CUDA).
        Collective: three small all-gathers (who asks, flag pages made, pages mapped), and if any rank of a
        gated channel fails a step of it, no channel is gated anywhere (a warning says why)."""
        asks = self.nccl and self.device.type == "cuda" and gating.wanted()
        short = gating.queues_short() if asks else None
        if short:
            log.warning("rank %d: FNPIPE_GATED_RECV=1 but %s; receives are not gated", self.rank, short)
            asks = False
        everyone = self.all_gather_json({"host": socket.gethostname(), "asks": asks, "token": uuid.uuid4().hex})

        def gated(a: int, b: int) -> bool:
            return everyone[a]["asks"] and everyone[b]["asks"] and everyone[a]["host"] == everyone[b]["host"]

        pairs = [(a, b) for a, b in sorted(self.channels) if gated(a, b)]
        if not pairs:
            return None
        paths = {r: f"/dev/shm/fnpipe-gates-{everyone[0]['token']}-{r}" for r in sorted({r for p in pairs for r in p})}
        mine = paths.get(self.rank)
        try:
            if self._gate_step(lambda: gating.Flags(mine, self.world_size, create=True) if mine else None,
                               "making its flag page") is None:
                return None
            out = self._gate_step(lambda: gating.Gates(
                self.rank, self.world_size, paths, [a for a, b in pairs if b == self.rank],
                [b for a, b in pairs if a == self.rank], self.device, driver or gating.CudaDriver()) if mine else None,
                "mapping the flag pages")
        finally:
            if mine and os.path.exists(mine):
                os.unlink(mine)  # every rank has mapped it (or given up): the name is not needed
        if not isinstance(out, gating.Gates):
            return None
        log.info("rank %d: gated receives from ranks %s", self.rank, list(out.incoming))
        return out

    def _gate_step(self, make: Any, what: str, off: str = "receives are not gated (each waits on the GPU for its "
                   "sender)") -> Any:
        """`make()` on every rank, then whether all succeeded; a rank's failure turns the feature off everywhere
        (a warning starting with `off` says why)."""
        try:
            made, error = make(), None
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it before anyone goes on
            made, error = None, f"rank {self.rank}: {what}: {type(exc).__name__}: {exc}"
        errors = [e for e in self.all_gather_json(error) if e]
        if errors:
            log.warning("%s: %s", off, "; ".join(errors))
            if isinstance(made, gating.Gates):
                made.release()
            if isinstance(made, copying.Copies):
                made.close()
            return None
        return made if made is not None else True

    def prepare(self, receives: dict[int, int]) -> None:
        """Open copy-engine channels (`copies`, FNPIPE_P2P=copy) for a step whose largest message from each peer
        is `receives[peer]` bytes, once per transport. Collective: every rank calls it (a Step does, when made)."""
        if not self.prepared:
            self.prepared = True
            self.copies = self._open_copies(receives)

    def resident_bytes(self, rank: int) -> int:
        """Device bytes the transport holds on `rank` for as long as it is open: its copy-engine rings (every rank
        knows every rank's, from the gather that opened them)."""
        return self.rings.get(rank, 0)

    def settle(self, what: str) -> None:
        """At the end of a step: with copy-engine channels, wait for this rank's transfers and raise if a failure
        (here or at a peer) may have touched what it received (`copies.Copies.settle`)."""
        if self.copies is not None and self.copies.settle() is not None:
            self._copies_alive(what)

    def _open_copies(self, receives: dict[int, int], driver: copying.Driver | None = None) -> copying.Copies | None:
        """Copy-engine rings on the channels whose two ends share a host and ask for them, and whose receiver
        receives something. Collective: four small all-gathers; a rank's failure in any step leaves every
        channel on NCCL (a warning says why)."""
        try:  # a bad setting on one rank is every rank's error, after the gather (not a peer's timeout)
            asks, error = copying.asks(self.nccl, self.device), None
            slots = copying.depth() if asks else 0
        except PlanError as exc:
            asks, slots, error = False, 0, f"rank {self.rank}: {exc}"
        short = gating.queues_short() if asks else None
        if short:
            log.warning("rank %d: FNPIPE_P2P=copy but %s; transfers stay on NCCL", self.rank, short)
            asks = False
        everyone = self.all_gather_json({"host": socket.gethostname(), "asks": asks, "token": uuid.uuid4().hex,
                                         "slots": slots, "receives": {str(p): n for p, n in receives.items()},
                                         "error": error})
        errors = [e["error"] for e in everyone if e["error"]]
        if errors:
            raise PlanError("; ".join(errors))

        def near(a: int, b: int) -> bool:
            return everyone[a]["asks"] and everyone[b]["asks"] and everyone[a]["host"] == everyone[b]["host"] \
                and str(a) in everyone[b]["receives"]

        pairs = [(a, b) for a, b in sorted(self.channels) if near(a, b)]
        if not pairs:
            return None
        off = "transfers stay on NCCL (no copy-engine channels)"
        paths = {r: f"/dev/shm/fnpipe-copies-{everyone[0]['token']}-{r}" for r in sorted({r for p in pairs for r in p})}
        mine = paths.get(self.rank)
        made: copying.Copies | None = None
        try:
            if self._gate_step(lambda: gating.Flags(mine, copying.words(self.world_size), create=True) if mine else None,
                               "making its count page", off) is None:
                return None

            def rings() -> Any:
                nonlocal made
                if not mine:
                    return {}
                made = copying.Copies(self.rank, self.world_size, paths, self.device, driver or copying.CudaDriver(),
                                      self.timeout)
                return made.rings({a: receives[a] for a, b in pairs if b == self.rank}, everyone[self.rank]["slots"])

            exported = self._exported(rings, off)
            if exported is None:
                if made is not None:
                    made.close()
                return None
            if self._gate_step(lambda: made.connect(exported) if made is not None else None, "opening the peers' rings",
                               off) is None:
                if made is not None:
                    made.close()
                return None
        finally:
            if mine and os.path.exists(mine):
                os.unlink(mine)  # every rank has mapped it (or given up): the name is not needed
        self.rings = {r: sum(size * slots for _, _, size, slots in rings.values()) for r, rings in enumerate(exported)}
        if made is not None:
            log.info("rank %d: copy-engine channels from ranks %s, to ranks %s (%d slots)", self.rank,
                     sorted(made.incoming), sorted(made.outgoing), everyone[self.rank]["slots"])
        return made

    def _exported(self, make: Any, off: str) -> list[Any] | None:
        """Every rank's `make()` (its exported rings), or None on every rank if any rank failed to make them."""
        try:
            mine, error = make(), None
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it before anyone goes on
            mine, error = {}, f"rank {self.rank}: making its rings: {type(exc).__name__}: {exc}"
        told = self.all_gather_json([mine, error])
        errors = [e for _, e in told if e]
        if errors:
            log.warning("%s: %s", off, "; ".join(errors))
            return None
        return [m for m, _ in told]

    def receiving(self, peer: int) -> contextlib.AbstractContextManager[None]:
        """Where buffers for receives from `peer` are made (`post(..., pooled=True)`): its copy or gate stream."""
        stream = self.copies.receiving(peer) if self.copies is not None else None
        if stream is not None:
            return torch.cuda.stream(stream)
        return self.gates.receiving(peer) if self.gates is not None and peer in self.gates.received \
            else contextlib.nullcontext()

    def post(self, ops: Sequence[tuple[str, int, torch.Tensor]], *, pooled: bool = False) -> list[Any]:
        works = []
        gates, copies = self.gates, self.copies
        self._copies_alive("posting transfers")
        for op, peer, t in ops:
            where = f"{op} {'to' if op == 'send' else 'from'} rank {peer}"
            if copies is not None and copies.carries(op, peer, t):  # a driver error here is this rank's own
                work = copies.send(peer, t) if op == "send" else copies.receive(peer, t, pooled=pooled)
                works.append(_DistWork(work, where, (peer,)))
                continue
            try:  # gloo raises here at once when the peer's socket is already gone
                if op == "send":
                    work = dist.isend(t, peer, group=self.channels[(self.rank, peer)])
                    if gates is not None and peer in gates.sent:
                        gates.sent_one(peer)
                else:
                    receive = functools.partial(dist.irecv, t, peer, group=self.channels[(peer, self.rank)])
                    gated = gates is not None and peer in gates.received
                    if pooled and copies is not None and copies.receiving(peer) is not None:
                        t.record_stream(torch.cuda.current_stream(self.device))  # made in the copy stream's pool
                    work = gates.receive(peer, t, receive, pooled=pooled) if gated else receive()
            except RuntimeError as exc:
                raise self._failure(where, exc, (peer,)) from exc
            works.append(_DistWork(work, where, (peer,)))
        return works

    def _copies_alive(self, what: str) -> None:
        """Raise if the copy-engine channels' watch found a transfer past the timeout (`copies.Copies.check`)."""
        copies = self.copies
        if copies is not None and copies.failure is not None:
            peers = () if copies.late_peer is None else (copies.late_peer,)
            error = self._failure(what, RuntimeError("timed out"), peers, copies.timeout)
            raise CommTimeoutError(f"{error} The copy-engine channels' watch: {copies.failure}.")

    def wait(self, handle: Any, what: str) -> None:
        if handle is None:
            return
        self._copies_alive(f"{what} ({handle.where})")
        start = time.monotonic()
        try:  # NCCL: wait() only orders streams; the process group's watchdog enforces the timeout
            handle.work.wait() if self.nccl else handle.work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self._failure(f"{what} ({handle.where})", exc, handle.peers, time.monotonic() - start) from exc

    def _failure(self, what: str, exc: BaseException, peers: Sequence[int], waited: float = 0.0) -> CommTimeoutError:
        """The error a survivor raises: which rank, which wait, how long, who to look at and what to check.
        The backend's own text (source paths, socket errors) stays in the chained cause. This rank's gates open:
        nothing it queued waits on a peer that failed."""
        if getattr(self, "gates", None) is not None:
            self.gates.release()
        if getattr(self, "copies", None) is not None:
            self.copies.release()
        return CommTimeoutError(failure_message(self.rank, what, peers, waited=waited, timeout=self.timeout,
                                                timed_out="timed out" in str(exc).lower()))

    def all_reduce(self, t: torch.Tensor, group: tuple[int, ...]) -> None:
        if group not in self.groups:
            raise KeyError(f"group {group} was not created at start-up")
        where = f"all-reduce over ranks {list(group)}"
        peers = tuple(r for r in group if r != self.rank)
        try:
            work = dist.all_reduce(t, group=self.groups[group], async_op=True)
        except RuntimeError as exc:
            raise self._failure(where, exc, peers) from exc
        self.wait(_DistWork(work, where, peers), "summing")

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, group: tuple[int, ...]) -> None:
        """`out` = this rank's 1/len(group) slice of `t` summed over `group` (ZeRO-1's grad reduction)."""
        self._collective(_REDUCE_SCATTER, out, t, group, "reduce-scatter")

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, group: tuple[int, ...]) -> None:
        """`out` = every member's `t`, concatenated in group order (ZeRO-1's param gather)."""
        self._collective(_ALL_GATHER, out, t, group, "all-gather")

    def _collective(self, op: Any, out: torch.Tensor, t: torch.Tensor, group: tuple[int, ...], name: str) -> None:
        if group not in self.groups:
            raise KeyError(f"group {group} was not created at start-up")
        where = f"{name} over ranks {list(group)}"
        peers = tuple(r for r in group if r != self.rank)
        try:
            work = op(out, t, group=self.groups[group], async_op=True)
        except RuntimeError as exc:
            raise self._failure(where, exc, peers) from exc
        self.wait(_DistWork(work, where, peers), name)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on all), as tensors on the CPU: data, never pickled objects."""
        everyone = tuple(range(self.world_size))
        mine = t.to(self.device).contiguous()
        out = [torch.empty_like(mine) for _ in everyone]
        where = "all-gather over all ranks"
        peers = tuple(r for r in everyone if r != self.rank)
        try:
            work = dist.all_gather(out, mine, group=self.groups[everyone], async_op=True)
        except RuntimeError as exc:
            raise self._failure(where, exc, peers) from exc
        self.wait(_DistWork(work, where, peers), "gathering")
        return [o.cpu() for o in out]

    def close(self) -> None:
        """Destroy the groups this transport made (its channels' and sums'); the world's stays. Dropping
        them joins their gloo worker threads (destroy_process_group alone leaves them running)."""
        if self.gates is not None:
            self.gates.release()
        if self.copies is not None:
            self.copies.close()
            self.copies, self.rings = None, {}
        for group in [*self.channels.values(), *self.groups.values(), *([self.patient] if self.patient else [])]:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as exc:  # a peer may be gone; the group dies with the process then
                log.debug("destroying a group: %s", exc)
        self.channels, self.groups, self.patient = {}, {}, None

    def gather_after_compile(self, obj: Any) -> list[Any]:
        """`all_gather_json` for the first gather after every rank compiled its stage programs: it waits up to
        COMPILE_WAIT seconds (or the step timeout, if longer) for the slowest rank's compile, over a gloo group
        of its own, so no NCCL collective is in flight while a rank still compiles."""
        start = time.monotonic()
        try:
            return gather_json(obj, group=self.patient, device=torch.device("cpu"))
        except RuntimeError as exc:
            waited = time.monotonic() - start
            raise CommTimeoutError(
                f"rank {self.rank}: waited {waited:.1f} s (limit {self.patience:.0f} s) for the other ranks to finish "
                "compiling their stage programs: one of them died (check the logs for its error), hangs, or "
                "compiles for longer; to wait longer set FNPIPE_COMPILE_WAIT=<seconds> on every rank. The "
                "transport's own message is the chained cause.") from exc

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON values only: what comes from a peer is parsed, never unpickled)."""
        start = time.monotonic()
        try:
            return gather_json(obj, group=self.groups[tuple(range(self.world_size))], device=self.device)
        except RuntimeError as exc:
            peers = tuple(r for r in range(self.world_size) if r != self.rank)
            raise self._failure("all-gather over all ranks", exc, peers, time.monotonic() - start) from exc


def failure_message(rank: int, what: str, peers: Sequence[int], *, waited: float, timeout: float,
                    timed_out: bool) -> str:
    """`rank 0: receiving b4 (recv from rank 1) failed after 10.0 s (timeout 10 s): rank 1 died or hangs; ...`"""
    who, logs = (f"rank {peers[0]}", "check its log") if len(peers) == 1 else \
        (f"one of ranks {list(peers)}", "check their logs") if peers else ("a peer", "check the other ranks' logs")
    why = ("no answer within the timeout: it hangs, is stuck in a slower step, or waits for something else"
           if timed_out else "the connection closed: it exited, crashed or was killed, e.g. out of memory")
    return (f"rank {rank}: {what} failed after {waited:.1f} s (timeout {timeout:g} s): {who} died or hangs; "
            f"{logs} for the error that stopped it ({why}). If every rank is alive, check that all run the same "
            f"script with the same inputs and options, and that one step's work fits in {timeout:g} s "
            "(parallelize(timeout=...)). The transport's own message is the chained cause.")


def close_all() -> None:
    """Close every transport still open: at exit, while Python is whole. A step kept to the end of a
    script would otherwise keep gloo's worker threads alive into interpreter finalisation, where one
    dropping the last reference to a tensor aborts the process ("terminate called without an active
    exception") after the script has printed its results. Skipped when the program died of an exception:
    a dead peer's pending receive could hold a thread until the timeout."""
    if getattr(sys, "last_value", None) is not None:
        return
    for t in list(_OPEN):
        t.close()


atexit.register(close_all)


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = json.dumps(obj, sort_keys=True, allow_nan=True).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _home(group: Any) -> torch.device:
    """Where a collective's tensors must live: the current GPU under NCCL, the CPU under gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _decode(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().tolist()).decode())


def gather_json(obj: Any, *, group: Any = None, device: torch.device | None = None) -> list[Any]:
    """All-gather of a JSON value as bytes in tensors (sizes first, then the padded bytes): objects from
    peers are parsed as JSON, never unpickled, whoever sends them."""
    device = device or _home(group)
    mine = _encode(obj, device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(n.item()) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [_decode(p[:int(n.item())]) for p, n in zip(parts, sizes)]


def broadcast_json(obj: Any, *, src: int = 0, device: torch.device | None = None, group: Any = None) -> Any:
    """Rank `src`'s JSON value on every rank (the others pass anything), sent as bytes in tensors."""
    device = device or _home(group)
    mine = _encode(obj, device) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8, device=device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = mine if dist.get_rank() == src else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return _decode(buf)


def broadcast_after_local_work(obj: Any, timeout: float, what: str, *, src: int = 0) -> Any:
    """`broadcast_json` from `src` after work only `src` does (rank 0's calibration of the model's ops): the
    others wait up to `compile_wait(timeout)` seconds (FNPIPE_COMPILE_WAIT), not the step's timeout, on a gloo
    group made for it and destroyed after (no NCCL collective in flight while `src` still works)."""
    patience = compile_wait(timeout)
    start, group = time.monotonic(), None
    try:  # the others wait for `src` in new_group already (gloo connects through the store)
        group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=patience),
                               backend="gloo")
        return broadcast_json(obj, src=src, device=torch.device("cpu"), group=group)
    except RuntimeError as exc:
        raise CommTimeoutError(
            f"rank {dist.get_rank()}: waited {time.monotonic() - start:.1f} s (limit {patience:.0f} s) for rank "
            f"{src} to finish {what}: it died (check its log for the error), hangs, or needs longer; to wait "
            "longer set FNPIPE_COMPILE_WAIT=<seconds> on every rank. The transport's own message is the chained "
            "cause.") from exc
    finally:
        if group is not None:
            dist.destroy_process_group(group)


class _DistWork:
    """A posted torch.distributed request and what it was, so that a failure names the peer."""

    def __init__(self, work: Any, where: str, peers: tuple[int, ...]) -> None:
        self.work, self.where, self.peers = work, where, peers

    def is_completed(self) -> bool:
        return self.work.is_completed()


class DeadlockError(RuntimeError):
    """Every rank of an in-process run waits on another: the program can never finish."""


class _LocalWork:
    """A posted in-process send or receive: done once matched with its peer."""

    def __init__(self, tensor: torch.Tensor, what: str) -> None:
        self.tensor, self.what, self.done = tensor, what, False

    def is_completed(self) -> bool:
        return self.done


class Hub:
    """Shared state of an in-process run: P2P matched in issue order per (src, dst), rendezvous sums."""

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.cv = threading.Condition()
        self.sends: dict[tuple[int, int], list[_LocalWork]] = {}
        self.recvs: dict[tuple[int, int], list[_LocalWork]] = {}
        self.reduces: dict[tuple[tuple[int, ...], int], dict[int, Any]] = {}
        self.waiting: dict[int, tuple[str, Any]] = {}
        self.alive = set(range(world_size))
        self.failure: str | None = None

    def _match(self, key: tuple[int, int]) -> None:
        sends, recvs = self.sends.get(key, []), self.recvs.get(key, [])
        while sends and recvs:
            s, r = sends.pop(0), recvs.pop(0)
            if s.tensor.shape != r.tensor.shape or s.tensor.dtype != r.tensor.dtype:
                self.failure = (f"rank {key[0]} sent {s.tensor.dtype}{list(s.tensor.shape)} but rank {key[1]} "
                                f"expected {r.tensor.dtype}{list(r.tensor.shape)}")
            else:
                r.tensor.copy_(s.tensor)
            s.done = r.done = True
        self.cv.notify_all()

    def post(self, rank: int, op: str, peer: int, t: torch.Tensor) -> _LocalWork:
        with self.cv:
            h = _LocalWork(t.detach().clone() if op == "send" else t, f"{op} {'to' if op == 'send' else 'from'} r{peer}")
            key = (rank, peer) if op == "send" else (peer, rank)
            (self.sends if op == "send" else self.recvs).setdefault(key, []).append(h)
            self._match(key)
            return h

    def block(self, rank: int, what: str, done) -> None:
        """Wait until `done()`; raise if the run failed, timed out, or every live rank is blocked."""
        with self.cv:
            self.waiting[rank] = (what, done)
            try:
                deadline = threading.TIMEOUT_MAX if self.timeout is None else self.timeout
                if not self.cv.wait_for(lambda: done() or self.failure or self._deadlocked(), deadline):
                    self.failure = f"rank {rank}: {what} timed out after {self.timeout} s"
                if self.failure:
                    raise DeadlockError(self.failure) if "deadlock" in self.failure else CommTimeoutError(self.failure)
            finally:
                self.waiting.pop(rank, None)

    def _deadlocked(self) -> bool:
        if self.alive and set(self.waiting) == self.alive and not any(d() for _, d in self.waiting.values()):
            cycle = "; ".join(f"rank {r} waits on {w}" for r, (w, _) in sorted(self.waiting.items()))
            self.failure = f"deadlock: every rank is waiting ({cycle})"
            self.cv.notify_all()
            return True
        return False

    def exit(self, rank: int, error: str | None = None) -> None:
        with self.cv:
            self.alive.discard(rank)
            if error and not self.failure:
                self.failure = f"rank {rank} failed: {error}"
            self.cv.notify_all()


class LocalTransport:
    """One rank's view of a Hub: the runtime runs each rank in a thread of one process."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size
        self.seq: dict[tuple[int, ...], int] = {}

    def post(self, ops: Sequence[tuple[str, int, torch.Tensor]], *, pooled: bool = False) -> list[Any]:
        return [self.hub.post(self.rank, op, peer, t) for op, peer, t in ops]

    def receiving(self, peer: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def prepare(self, receives: dict[int, int]) -> None:
        pass  # threads of one process: no channels to open

    def resident_bytes(self, rank: int) -> int:
        return 0

    def settle(self, what: str) -> None:
        pass  # the hub's transfers are done when their waits return

    def wait(self, handle: Any, what: str) -> None:
        self.hub.block(self.rank, f"{handle.what} ({what})", lambda: handle.done)

    def all_reduce(self, t: torch.Tensor, group: tuple[int, ...]) -> None:
        n = self.seq.get(group, 0)
        self.seq[group] = n + 1
        key = (group, n)
        hub = self.hub
        with hub.cv:
            slot = hub.reduces.setdefault(key, {})
            slot[self.rank] = t.detach().clone()
            hub.cv.notify_all()
        hub.block(self.rank, f"all-reduce over ranks {list(group)}", lambda: len(slot) == len(group))
        total = sum(slot[r].clone() for r in group)  # rank order: every member gets identical bits
        t.copy_(total)

    def close(self) -> None:
        pass  # nothing of the process's is held: the hub is plain memory

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t`, in rank order (each a copy)."""
        return [x.clone() for x in self._exchange(t.detach().cpu().clone())]

    def all_gather_json(self, obj: Any) -> list[Any]:
        return self._exchange(json.loads(json.dumps(obj)))  # what a real job's peers would see

    gather_after_compile = all_gather_json  # threads of one process compile side by side: no skew to wait out

    def _exchange(self, obj: Any) -> list[Any]:
        box = [None] * self.world_size
        group = tuple(range(self.world_size))
        n = self.seq.get(("obj",), 0)
        self.seq[("obj",)] = n + 1
        with self.hub.cv:
            slot = self.hub.reduces.setdefault((("obj",), n), {})
            slot[self.rank] = obj
            self.hub.cv.notify_all()
        self.hub.block(self.rank, "all-gather", lambda: len(slot) == len(group))
        for r in group:
            box[r] = slot[r]
        return box
