"""Copy-engine channels: between two GPUs of one host, a message crosses by the sender's copy engine into a ring
of slots on the receiver's GPU, and both ends wait on the GPU for counts in host memory, never with an SM.

An NCCL receive posted before its sender is ready runs a kernel that holds SMs while it waits: compute beside one
runs 1.37 x slower on an H100, against 1.023 x beside copy-engine copies (`benchmarks/contention.py`, 2 x H100,
2026-11-26). Gating the receives (`gates`) took the spinning away but left the transfer to start only once the
data was ready. Here nothing spins and nothing waits on the host:

Per one-way channel a -> b, b's GPU holds a ring of `depth` slots of `capacity` bytes (a tensor of b's caching
allocator, opened in a's process by CUDA IPC), and each rank has a page of counts in host shared memory
(`gates.Flags`, registered for the GPU): word `s` of b's page counts the messages from sender s that are in their
slots (*ready*), word `world + r` of a's page the messages receiver r has copied out of a's slots (*freed*).

- a's n-th message: a's send stream waits for a's compute stream (the data is made) and, once the ring has gone
  round (n > depth), for freed >= n - depth (slot (n - 1) % depth is empty again); copies the bytes into the slot
  (`cuMemcpyDtoDAsync`: a copy engine over NVLink, no kernel); writes ready = n into b's page.
- b's n-th receive: b's receive stream waits for ready >= n, copies the slot into the receive buffer (on b's GPU),
  writes freed = n into a's page.

A stream memory write is ordered after the stream's earlier work and fenced, so a count is seen only after the
bytes it counts. The buffers a message is read from (sender) and received into (receiver) are recorded on the
stream that uses them, so the caching allocator reuses their memory only after it. A message larger than the
channel's slot goes through the channel's NCCL communicator instead: both ends see the same sizes in the same order
(the static program), so they agree which message takes which path, and each path keeps its own order.

Waits the GPU does are bounded here, as NCCL's watchdog bounds its own: a thread checks every posted transfer and,
when one is not done `timeout` seconds after it was posted, opens every count of this rank from the host (no stream
waits for a peer that is gone) and marks the transport failed: its next call raises CommTimeoutError naming the
peer. Off unless `FNPIPE_P2P=copy`; channels whose two ends share a host, NCCL on CUDA.
"""
from __future__ import annotations

import collections
import ctypes
import os
import threading
import time
from typing import Any, Protocol, Sequence

import attrs
import torch

from ..errors import PlanError
from . import gates as gating

DEPTH = 2  # slots per ring: one message in flight while the one before is copied out
ALIGN = 256  # bytes: each slot starts at a multiple of this
# Rings a failed transport could not know were idle: a peer's copy may still land in them, so their memory is
# never handed back to the caching allocator (nor the IPC mappings closed).
_KEEP: list[Any] = []


def wanted() -> bool:
    """FNPIPE_P2P=copy: this rank asks for copy-engine channels (default "nccl": NCCL's kernels carry the data)."""
    text = os.environ.get("FNPIPE_P2P", "nccl")
    if text.strip().lower() not in ("nccl", "copy"):
        raise PlanError(f"FNPIPE_P2P={text!r}: give how tensors cross between GPUs of one host, \"nccl\" (NCCL's "
                         "kernels, the default) or \"copy\" (the copy engines, engine/execution/copies.py)")
    return text.strip().lower() == "copy"


def asks(nccl: bool, device: torch.device) -> bool:
    """Whether a rank asks for copy-engine channels: wanted, over NCCL, on a GPU."""
    return nccl and device.type == "cuda" and wanted()


def depth() -> int:
    """Slots per ring: FNPIPE_COPY_SLOTS, else DEPTH."""
    text = os.environ.get("FNPIPE_COPY_SLOTS", str(DEPTH))
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise PlanError(f"FNPIPE_COPY_SLOTS={text!r}: give the slots per copy-engine ring, a whole number >= 1 "
                         "(e.g. FNPIPE_COPY_SLOTS=2)")
    return n


def reserve_queues() -> None:
    """With FNPIPE_P2P=copy or FNPIPE_GATED_RECV=1, before CUDA starts: CUDA_DEVICE_MAX_CONNECTIONS=gates.QUEUES,
    unless the user chose a value (then `gates.queues_short` judges it). CUDA reads it when its context is made.
    A bad FNPIPE_P2P or FNPIPE_COPY_SLOTS raises here, on every rank that has it, before any communication."""
    if wanted():
        depth()
    if (wanted() or gating.wanted()) and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ \
            and not torch.cuda.is_initialized():
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(gating.QUEUES)


def capacity(nbytes: int) -> int:
    """A slot's bytes for messages of up to `nbytes`: rounded up to ALIGN."""
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


class Driver(gating.Driver, Protocol):
    """The CUDA driver calls copies need on top of gating's (`CudaDriver`; tests pass a host one)."""

    def copy(self, stream: Any, dst: int, src: int, nbytes: int) -> None: ...
    def export(self, address: int) -> tuple[str, int]: ...
    def open(self, handle: str) -> int: ...
    def close(self, address: int) -> None: ...


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # not c_char: a c_char array field reads up to its first NUL


def handle_hex(handle: _IpcHandle) -> str:
    """The 64 bytes of a CUipcMemHandle, as hex (JSON carries it to the peers)."""
    return ctypes.string_at(ctypes.addressof(handle), 64).hex()


def handle_of(text: str) -> _IpcHandle:
    """The CUipcMemHandle `handle_hex` wrote."""
    raw = _IpcHandle()
    ctypes.memmove(ctypes.addressof(raw), bytes.fromhex(text), 64)
    return raw


_OPENED: dict[str, list[int]] = {}  # IPC handle -> [base address here, opens]: each allocation mapped once


class CudaDriver(gating.CudaDriver):
    """libcuda through ctypes: gating's calls, device-to-device copies, and CUDA IPC of device memory."""

    LAZY_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

    def __init__(self) -> None:
        super().__init__()
        lib = ctypes.CDLL("libcuda.so.1")
        self._copy = gating._symbol(lib, "cuMemcpyDtoDAsync")
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._range = gating._symbol(lib, "cuMemGetAddressRange")
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self._export = lib.cuIpcGetMemHandle
        self._export.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        self._open = gating._symbol(lib, "cuIpcOpenMemHandle")
        self._open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        self._close = lib.cuIpcCloseMemHandle
        self._close.argtypes = [ctypes.c_uint64]

    def copy(self, stream: Any, dst: int, src: int, nbytes: int) -> None:
        gating._check(self._copy(dst, src, nbytes, stream.cuda_stream), "cuMemcpyDtoDAsync")

    def export(self, address: int) -> tuple[str, int]:
        """(the IPC handle of the allocation holding `address`, as hex; `address`'s offset in it)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        gating._check(self._range(ctypes.byref(base), ctypes.byref(size), address), "cuMemGetAddressRange")
        handle = _IpcHandle()
        gating._check(self._export(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        return handle_hex(handle), address - base.value

    def open(self, handle: str) -> int:
        """The base address, in this process, of the allocation another process exported as `handle`. A handle
        opens once per process (CUDA refuses a second open of the same allocation): later opens share it."""
        held = _OPENED.get(handle)
        if held is not None:
            held[1] += 1
            return held[0]
        out = ctypes.c_uint64()
        gating._check(self._open(ctypes.byref(out), handle_of(handle), self.LAZY_PEER_ACCESS), "cuIpcOpenMemHandle")
        _OPENED[handle] = [int(out.value), 1]
        return int(out.value)

    def close(self, address: int) -> None:
        """Drop one open of the allocation at `address`; the last one unmaps it."""
        for handle, held in list(_OPENED.items()):
            if held[0] == address:
                held[1] -= 1
                if held[1] == 0:
                    del _OPENED[handle]
                    self._close(address)
                return


@attrs.define
class Outgoing:
    """This rank's end of a channel to `peer`: the peer's ring as mapped here, and the messages sent into it."""

    peer: int
    stream: Any
    remote: int  # device address of the ring's slot 0, in this process
    base: int  # the peer's allocation as opened here (closed on a clean close)
    depth: int
    capacity: int
    sent: int = 0


@attrs.define
class Incoming:
    """This rank's end of a channel from `peer`: its ring (on this GPU) and the messages received out of it."""

    peer: int
    stream: Any
    ring: torch.Tensor
    depth: int
    capacity: int
    received: int = 0

    def slot(self, n: int) -> int:
        return self.ring.data_ptr() + ((n - 1) % self.depth) * self.capacity


class CopyWork:
    """A posted copy-engine send or receive: done when its stream passes the event recorded after it."""

    def __init__(self, event: Any, device: torch.device, what: str, peer: int) -> None:
        self.event, self.device, self.what, self.peer = event, device, what, peer
        self.posted = time.monotonic()

    def is_completed(self) -> bool:
        return True if self.event is None else bool(self.event.query())

    def wait(self) -> None:
        """The current stream waits for the transfer (as an NCCL work's `wait`): no host wait."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)


def words(world_size: int) -> int:
    """Words in a rank's page: ready counts per sender, freed counts per receiver, and one `failed` word."""
    return 2 * world_size + 1


_STREAMS: dict[str, list[Any]] = {}  # device -> copy streams a closed transport gave back (streams are never destroyed)


def _take_stream(driver: Driver, device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    free = _STREAMS.setdefault(str(device), [])
    return free.pop() if free else driver.stream(device)


class Copies:
    """This rank's copy-engine channels. Made in three collective steps by the transport (`DistTransport`):
    every rank of a channel makes its page (`gates.Flags(path, words(world), create=True)`); receivers make their
    rings (`rings`, exported for the senders); then everyone maps its peers' pages and opens their rings (`connect`).

    A failure anywhere taints every peer: the rank that fails (a transfer past the timeout, or its transport's
    error) writes its rank + 1 into the `failed` word of every peer's page before it opens its own counts (after
    which its queued copies may land in a live peer's slots out of turn), and every rank's watch, and its
    `settle` at the end of each step, read their own word: a rank never returns a step whose received data a
    failure may have touched."""

    def __init__(self, rank: int, world_size: int, paths: dict[int, str], device: torch.device, driver: Driver,
                 timeout: float) -> None:
        self.rank, self.world_size, self.device, self.driver = rank, world_size, device, driver
        self.paths, self.timeout = paths, timeout
        self.own = gating.Flags(paths[rank], words(world_size), create=False)
        self.own.device_address = driver.register(self.own.address, self.own.size)
        self.pages: dict[int, gating.Flags] = {}
        self.incoming: dict[int, Incoming] = {}
        self.outgoing: dict[int, Outgoing] = {}
        self.failure: str | None = None
        self.late_peer: int | None = None  # the peer a failure names (None: no one peer)
        self.works: collections.deque[CopyWork] = collections.deque()
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.watch: threading.Thread | None = None

    # -- setting up --------------------------------------------------------------------------------------
    def rings(self, capacities: dict[int, int], slots: int) -> dict[str, list[Any]]:
        """A ring per incoming peer (`capacities[peer]`: its slot's bytes), exported: {peer: [handle, offset,
        capacity, depth]} (JSON keys are strings). The ring's memory may have been a compute tensor's a moment
        ago: the gather that publishes the handles copies to the host after this rank's compute stream, so no
        earlier kernel still uses it when a sender's first copy lands."""
        out: dict[str, list[Any]] = {}
        for peer, size in sorted(capacities.items()):
            size = capacity(size)
            stream = _take_stream(self.driver, self.device)
            ring = torch.empty(slots * size, dtype=torch.uint8, device=self.device)
            self.incoming[peer] = Incoming(peer, stream, ring, slots, size)
            handle, offset = self.driver.export(ring.data_ptr())
            out[str(peer)] = [handle, offset, size, slots]
        return out

    def connect(self, exported: Sequence[dict[str, list[Any]]]) -> None:
        """Open the ring of every receiver this rank sends to (`exported[r]`: rank r's `rings`), map the pages of
        every peer, and start the watch."""
        for receiver, rings in enumerate(exported):
            if str(self.rank) in rings:
                handle, offset, size, slots = rings[str(self.rank)]
                stream = _take_stream(self.driver, self.device)
                base = self.driver.open(handle)
                self.outgoing[receiver] = Outgoing(receiver, stream, base + offset, base, slots, size)
        for peer in sorted({*self.incoming, *self.outgoing}):
            page = gating.Flags(self.paths[peer], words(self.world_size), create=False)
            page.device_address = self.driver.register(page.address, page.size)
            self.pages[peer] = page
        self.watch = threading.Thread(target=self._watch, name=f"fnpipe-copies-{self.rank}", daemon=True)
        self.watch.start()

    # -- transfers ---------------------------------------------------------------------------------------
    def carries(self, op: str, peer: int, t: torch.Tensor) -> bool:
        """Whether this message goes through the copy engine: the channel is one of ours and it fits a slot."""
        end = self.outgoing.get(peer) if op == "send" else self.incoming.get(peer)
        return end is not None and t.numel() * t.element_size() <= end.capacity

    def send(self, peer: int, t: torch.Tensor) -> CopyWork:
        """Queue `t` (contiguous) into `peer`'s ring behind this rank's compute stream."""
        end = self.outgoing[peer]
        end.sent += 1
        n = end.sent
        stream = end.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            t.record_stream(stream)  # its memory is not reused before the copy has read it
        if n > end.depth:  # the slot holds message n - depth until the receiver has copied it out
            self.driver.wait(stream, self.own.device_address + (self.world_size + peer) * gating.SLOT, n - end.depth)
        slot = end.remote + ((n - 1) % end.depth) * end.capacity
        self.driver.copy(stream, slot, t.data_ptr(), t.numel() * t.element_size())
        self.driver.write(stream, self.pages[peer].device_address + self.rank * gating.SLOT, n)
        return self._posted(stream, f"send {n} to rank {peer}", peer)

    def receive(self, peer: int, t: torch.Tensor, *, pooled: bool) -> CopyWork:
        """Queue the copy of `peer`'s next message into `t`. `pooled`: `t` was made inside `receiving(peer)` (the
        receive stream's pool); else the copy also waits for the compute stream to reach this point (`t` may reuse
        memory a queued compute kernel still reads), and `t` is recorded on the receive stream (its memory is
        not reused before the copy has written it, even if it is dropped unread)."""
        end = self.incoming[peer]
        end.received += 1
        n = end.received
        stream = end.stream
        if stream is not None:
            compute = torch.cuda.current_stream(self.device)
            if pooled:
                t.record_stream(compute)  # compute reads it: its memory waits for that before reuse
            else:
                stream.wait_stream(compute)
                t.record_stream(stream)
        self.driver.wait(stream, self.own.device_address + peer * gating.SLOT, n)
        self.driver.copy(stream, t.data_ptr(), end.slot(n), t.numel() * t.element_size())
        self.driver.write(stream, self.pages[peer].device_address + (self.world_size + self.rank) * gating.SLOT, n)
        return self._posted(stream, f"receive {n} from rank {peer}", peer)

    def receiving(self, peer: int) -> Any:
        """The stream whose pool receive buffers from `peer` come from (None: not one of ours, or not CUDA)."""
        end = self.incoming.get(peer)
        return None if end is None else end.stream

    def _posted(self, stream: Any, what: str, peer: int) -> CopyWork:
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        work = CopyWork(event, self.device, what, peer)
        with self.lock:
            self.works.append(work)
        return work

    # -- bounds, failures and the end ----------------------------------------------------------------------
    def tainted(self) -> int | None:
        """The rank whose failure reached this rank's page (its `failed` word), or None."""
        value = self.own.read(2 * self.world_size)
        return value - 1 if value else None

    def check(self) -> None:
        """Sweep finished transfers; fail the transport if a peer's failure reached this rank's page or a transfer
        is not done `timeout` s after it was posted."""
        with self.lock:
            while self.works and self.works[0].is_completed():
                self.works.popleft()
            late = next((w for w in self.works if time.monotonic() - w.posted > self.timeout
                         and not w.is_completed()), None)
        who = self.tainted()
        if who is not None and who != self.rank:
            self.fail(f"rank {who}'s copy-engine transfers failed, so what it sent or freed here is not to be "
                      "trusted", who)
        elif late is not None:
            self.fail(f"{late.what} (copy engine) not done {time.monotonic() - late.posted:.1f} s after it was posted",
                      late.peer)

    def fail(self, why: str, peer: int | None) -> None:
        """Mark this transport failed (the first reason stays), taint every peer and open this rank's counts."""
        if self.failure is None:
            self.failure, self.late_peer = why, peer
        self.release()

    def _watch(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # queries on this thread: this rank's GPU, not device 0
        while not self.closing.wait(min(1.0, self.timeout / 10)):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 -- a broken context: say so at the next call
                self.fail(f"watching the copy-engine transfers: {type(exc).__name__}: {exc}", None)
                return

    def release(self) -> None:
        """Taint every peer (its `failed` word), then open every count this rank waits on, from the host: each past
        every wait queued on it, so no stream waits for a peer that is gone. What arrives after is garbage; every
        rank it can reach raises (`check`, `settle`)."""
        for page in self.pages.values():
            if not page.read(2 * self.world_size):
                page.set(2 * self.world_size, self.rank + 1)
        for peer, end in self.incoming.items():
            self.own.set(peer, (end.received + gating.PAST) & 0xFFFFFFFF)
        for peer, end in self.outgoing.items():
            self.own.set(self.world_size + peer, (end.sent + gating.PAST) & 0xFFFFFFFF)

    def settle(self) -> str | None:
        """At the end of a step: wait for every transfer posted so far (bounded: the watch fails a transfer past
        the timeout and opens the counts, which ends the wait), then the reason this rank's data may be wrong,
        if any. The host waits for the GPU here, where a step over NCCL need not: the price of never returning
        numbers a failure may have touched."""
        for end in (*self.incoming.values(), *self.outgoing.values()):
            if end.stream is not None:
                end.stream.synchronize()
        self.check()
        return self.failure

    def close(self) -> None:
        """Wait (at most `timeout` s) for the transfers still queued, stop the watch, then close the peers' rings,
        give this rank's back, unmap the pages and keep the streams for the next transport. A transport that
        failed keeps it all (a peer's copy may still be landing), as `_KEEP`."""
        deadline = time.monotonic() + self.timeout
        while self.failure is None and not self._idle() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.closing.set()
        if self.watch is not None:
            self.watch.join(timeout=5.0)
        if self.failure is not None or not self._idle():
            self.release()
            _KEEP.append((self.incoming, self.outgoing, self.own, self.pages))
            return
        for end in self.outgoing.values():
            self.driver.close(end.base)
        for end in (*self.incoming.values(), *self.outgoing.values()):
            if end.stream is not None:
                _STREAMS.setdefault(str(self.device), []).append(end.stream)
        for page in (self.own, *self.pages.values()):
            self.driver.unregister(page.address)
        self.incoming, self.outgoing, self.pages = {}, {}, {}

    def _idle(self) -> bool:
        with self.lock:
            return all(w.is_completed() for w in self.works)
