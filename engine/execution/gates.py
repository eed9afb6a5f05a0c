"""Gated receives: an NCCL receive is queued on the GPU only once its sender's data is ready.

A posted NCCL receive runs a kernel that holds SMs while it waits for its sender. Compute beside one runs
1.37 x slower on an H100 (1.22 x with 4 p2p channels), against 1.015 x beside transfers that are moving
(`benchmarks/contention.py`, 2 x H100, 2026-11-26); in a depth-4 zbv step that made every stage program run
10-15 % slower than timed alone. So here the receive waits without a kernel: per one-way channel a -> b the
sender's compute stream, right after the message's producer, writes the channel's message count into host
memory shared on the node (`cuStreamWriteValue32`), and the receiver queues its NCCL receive on a stream of its
own behind a wait on that count (`cuStreamWaitValue32`: the GPU's front end polls; no SM, no host thread).
The data still goes through NCCL, whose own protocol keeps it right: a flag seen early or late changes only
when the receive kernel starts, never what it receives.

Receive buffers are made on the channel's gate stream (its own pool in the caching allocator) and recorded on
the compute stream that reads them, so the receive, no longer ordered after the receiver's compute, never
writes into memory a compute kernel still reads; that pool is the gate stream's alone, so memory freed there is
not reused by compute and the reverse (a little more memory than `step.memory()` models). The gate streams are
made for gating alone (not from torch's shared stream pool, where an NCCL stream may be the same one). On close,
and when a wait fails, the receiver writes counts past every queued wait into its own flags from the host, so no
gate keeps a stream waiting for a peer that is gone.

Only channels whose two ends share a host and whose two ranks both ask for it are gated (the flags are host
shared memory); NCCL on CUDA only. Off unless `FNPIPE_GATED_RECV=1`: on 4 x H100 (2026-11-26, GPT 1 B, zbv at
p = 4, one launch each way) it cut the NCCL kernels' time per rank from 10-20 ms to 2-10 ms and the compute
kernels' slowdown beside them from 1.01-1.04 x to 0.99-1.03 x, but the step did not get faster (0.1061 s
gated, 0.1042 s not): what the receives no longer spin for they now wait for, idle. Kept for workloads where
SMs are the bottleneck beside long waits (benchmarks/NOTES.md).
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Any, Iterator, Protocol, Sequence

import torch

SLOT = 64  # bytes between two senders' flags: a cache line each
PAST = 2 ** 30  # a released gate reads its count + PAST: the GPU's >= is cyclic (int32(flag - value) >= 0)
# Every page of flags mapped and registered, kept for the life of the process: a stream may still hold a
# memory operation on one after its transport closed (a failed step), and unmapping pinned memory under it
# is undefined. A page a transport, 4 KiB each.
_KEEP: list["Flags"] = []


def wanted() -> bool:
    """FNPIPE_GATED_RECV (default off): whether this rank asks for gated receives."""
    return os.environ.get("FNPIPE_GATED_RECV", "0").strip().lower() in ("1", "true", "yes", "on")


QUEUES = 32  # CUDA_DEVICE_MAX_CONNECTIONS that streams waiting on the GPU need (gates, copy-engine channels)


def queues_short() -> str | None:
    """Why the device's hardware queues are too few for streams that wait on the GPU, or None. A stream memory wait
    blocks the hardware queue it is on, and with CUDA's default 8 queues a rank's waiting streams, NCCL's streams
    and its compute stream share them: a stream waiting for a peer could hold up compute queued behind it (and
    the peer may need that compute's output: a deadlock across ranks until a timeout). With QUEUES each stream of
    a rank has its own. `engine.init` asks for them (`reserve_queues`)."""
    text = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    try:
        enough = text is not None and int(text) >= QUEUES
    except ValueError:
        enough = False
    if enough:
        return None
    return (f"CUDA_DEVICE_MAX_CONNECTIONS={text} (needs {QUEUES}: a stream waiting for a peer must not share a hardware "
            f"queue with compute); set CUDA_DEVICE_MAX_CONNECTIONS={QUEUES} before CUDA starts (engine.init sets it "
            "when asked for gated receives or copy-engine channels and CUDA has not started yet)")


def usable() -> bool:
    """Whether the device's hardware queues leave a stream that waits a queue of its own (`queues_short`)."""
    return queues_short() is None


def after(flag: int, value: int) -> bool:
    """The GPU's CU_STREAM_WAIT_VALUE_GEQ on 32-bit words: `flag` is at or past `value`, cyclically."""
    return ((flag - value) & 0xFFFFFFFF) < 2 ** 31


class Driver(Protocol):
    """The CUDA driver calls gating needs (`CudaDriver`; tests pass a recording one)."""

    def stream(self, device: torch.device) -> Any: ...
    def register(self, address: int, size: int) -> int: ...
    def unregister(self, address: int) -> None: ...
    def write(self, stream: Any, device_address: int, value: int) -> None: ...
    def wait(self, stream: Any, device_address: int, value: int) -> None: ...


class CudaDriver:
    """libcuda through ctypes: host memory registered for the GPU, and stream memory operations."""

    MAPPED = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
    GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ (a counter: >= is enough, the value only grows)

    NON_BLOCKING = 0x1  # CU_STREAM_NON_BLOCKING

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._stream = lib.cuStreamCreate
        self._stream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._register = lib.cuMemHostRegister_v2
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._unregister = lib.cuMemHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._pointer = lib.cuMemHostGetDevicePointer_v2
        self._pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self._write = _symbol(lib, "cuStreamWriteValue32")
        self._write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait = _symbol(lib, "cuStreamWaitValue32")
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

    def stream(self, device: torch.device) -> Any:
        """A stream of its own (never destroyed: gates live as long as the process may queue on them)."""
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # the device's context is current on this thread
            out = ctypes.c_void_p()
            _check(self._stream(ctypes.byref(out), self.NON_BLOCKING), "cuStreamCreate")
        return torch.cuda.ExternalStream(out.value, device=device)

    def register(self, address: int, size: int) -> int:
        _check(self._register(address, size, self.MAPPED), "cuMemHostRegister")
        out = ctypes.c_uint64()
        _check(self._pointer(ctypes.byref(out), address, 0), "cuMemHostGetDevicePointer")
        return int(out.value)

    def unregister(self, address: int) -> None:
        self._unregister(address)

    def write(self, stream: Any, device_address: int, value: int) -> None:
        _check(self._write(stream.cuda_stream, device_address, value, 0), "cuStreamWriteValue32")

    def wait(self, stream: Any, device_address: int, value: int) -> None:
        _check(self._wait(stream.cuda_stream, device_address, value, self.GEQ), "cuStreamWaitValue32")


def _symbol(lib: Any, name: str) -> Any:
    try:
        return getattr(lib, name + "_v2")
    except AttributeError:
        return getattr(lib, name)


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {code}")


class Flags:
    """One rank's page of flags in /dev/shm: slot `s` (bytes 64 s ..) counts the messages sender `s` has ready.
    Mapped by its owner (to wait on and to release) and by every sender on the host (to write)."""

    def __init__(self, path: str, world_size: int, *, create: bool) -> None:
        self.path = path
        self.size = -(-world_size * SLOT // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.size)
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.device_address = 0

    def read(self, sender: int) -> int:
        return int.from_bytes(self.map[sender * SLOT:sender * SLOT + 4], "little")

    def set(self, sender: int, value: int) -> None:
        self.map[sender * SLOT:sender * SLOT + 4] = value.to_bytes(4, "little")


class Gates:
    """This rank's gates: the flags of its own incoming channels and of the senders' side of its outgoing ones.

    `incoming` and `outgoing` are the peers of gated channels (same host). `paths[r]` is rank r's flag file.
    Counts are per channel and per message, in post order: NCCL matches a channel's messages in order, so the
    n-th receive from `peer` is the n-th send to it.
    """

    def __init__(self, rank: int, world_size: int, paths: dict[int, str], incoming: Sequence[int],
                 outgoing: Sequence[int], device: torch.device, driver: Driver) -> None:
        self.rank, self.device, self.driver = rank, device, driver
        self.incoming, self.outgoing = tuple(incoming), tuple(outgoing)
        self.own = Flags(paths[rank], world_size, create=False)
        self.peers = {p: Flags(paths[p], world_size, create=False) for p in self.outgoing}
        for flags in (self.own, *self.peers.values()):
            _KEEP.append(flags)
            flags.device_address = driver.register(flags.address, flags.size)
        self.received = {p: 0 for p in self.incoming}
        self.sent = {p: 0 for p in self.outgoing}
        self.streams = {p: driver.stream(device) for p in self.incoming} if device.type == "cuda" else {}

    @contextlib.contextmanager
    def receiving(self, peer: int) -> Iterator[None]:
        """Inside: buffers made for receives from `peer` come from its gate stream's pool."""
        stream = self.streams.get(peer)
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def receive(self, peer: int, t: torch.Tensor, post: Any, *, pooled: bool) -> Any:
        """`post()` (the receive from `peer` into `t`) queued behind the gate of the channel's next message.
        `pooled`: `t` was made inside `receiving(peer)`; else the receive also waits for the compute stream to
        reach this point (`t` may reuse memory a queued compute kernel still reads), as an ungated one does."""
        self.received[peer] += 1
        stream = self.streams.get(peer)
        if stream is None:  # not CUDA: tests drive the flags through a recording driver
            self.driver.wait(None, self.own.device_address + peer * SLOT, self.received[peer])
            return post()
        compute = torch.cuda.current_stream(self.device)
        if pooled:
            t.record_stream(compute)  # the compute stream reads it: its memory waits for that before reuse
        else:
            stream.wait_stream(compute)
        self.driver.wait(stream, self.own.device_address + peer * SLOT, self.received[peer])
        with torch.cuda.stream(stream):
            return post()

    def sent_one(self, peer: int) -> None:
        """After posting a send to `peer`: its flag counts the message once the current stream has its data."""
        self.sent[peer] += 1
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.driver.write(stream, self.peers[peer].device_address + self.rank * SLOT, self.sent[peer])

    def release(self) -> None:
        """Open every gate of this rank for good, from the host: each flag set past every wait queued on it (the
        GPU compares cyclically, so not to a "largest" value), and no stream waits for a peer that is gone.
        The pages stay mapped and registered (`_KEEP`)."""
        for peer in self.incoming:
            self.own.set(peer, (self.received[peer] + PAST) & 0xFFFFFFFF)
