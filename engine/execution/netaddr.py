"""Which address rank 0 offers the others, and which interface each rank's gloo sockets use.

Under mpirun nobody names the master: rank 0 binds the rendezvous store and broadcasts its address.
- Every rank on one host (MPI's shared-memory communicator spans the world): loopback, and gloo /
  NCCL sockets on `lo` (nothing listens on a routable address).
- Several hosts: `FNPIPE_MASTER_ADDR` if set; else rank 0 offers every IPv4 address of its up,
  non-loopback interfaces (the one its host name resolves to first), each rank probes them over TCP,
  and the first address that every rank reached wins (one MPI all-reduce). Hosts with several
  networks (a management net that cannot reach the others, docker bridges) thus pick the one that
  works, with no flag. Each rank then points gloo at the interface that carries its traffic to that
  address (`GLOO_SOCKET_IFNAME`, unless the user set it): gloo otherwise binds what the host name
  resolves to, which is loopback on many distributions and absent inside containers or namespaces.
  NCCL picks its own interfaces (it skips `lo` and `docker*`); set NCCL_SOCKET_IFNAME to steer it.
Under torchrun the master is given (`MASTER_ADDR`); only the gloo interface is chosen here. torchrun
names node 0's agent by its fully qualified host name; where that resolves to loopback (`127.0.0.1 myhost`
in /etc/hosts) the other nodes cannot reach it, and torchrun's own `--local-addr <node 0's address>` on
node 0 is the fix: `check_master` says so in the log before the ranks wait.
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Sequence

PROBE_TIMEOUT = 3.0
_SIOCGIFADDR, _SIOCGIFFLAGS = 0x8915, 0x8913
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def interfaces() -> dict[str, str]:
    """Interface name -> IPv4 address, for every interface that is up and has one (Linux ioctls; {}
    where they do not exist, and the host name's address is all `candidates` offers)."""
    try:
        import fcntl
    except ImportError:
        return {}
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            if flags & _IFF_UP:
                out[name] = addr
    return out


def candidates() -> list[str]:
    """This host's addresses another host might reach: the host name's first, then every other
    up, non-loopback IPv4 address; loopback alone when there is none."""
    mine = [a for a in interfaces().values() if not a.startswith("127.")]
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = ""
    ordered = ([named] if named in mine else []) + [a for a in mine if a != named]
    return ordered or ["127.0.0.1"]


def interface_of(local_addr: str) -> str | None:
    """The interface holding `local_addr`, if any."""
    return next((name for name, addr in interfaces().items() if addr == local_addr), None)


def route_to(addr: str, port: int = 9) -> str:
    """The local address this host sends from to reach `addr` (a UDP connect: no packet leaves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, port))
        return s.getsockname()[0]


def reachable(addrs: Sequence[str], port: int, timeout: float = PROBE_TIMEOUT) -> list[bool]:
    """For each of `addrs`, whether a TCP connection to it at `port` opens from here."""
    out = []
    for addr in addrs:
        try:
            with socket.create_connection((addr, port), timeout=timeout):
                out.append(True)
        except OSError:
            out.append(False)
    return out


def probe_listener() -> tuple[socket.socket, int]:
    """A socket listening on every interface, for the others' probes (closed once they are done)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", 0))
    sock.listen(1024)
    return sock, sock.getsockname()[1]


def use_interface_towards(master: str) -> None:
    """Point gloo at the interface this rank reaches `master` through (unless the user chose one)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        name = interface_of(route_to(socket.gethostbyname(master)))
    except OSError:
        return  # no route we can name: gloo falls back to its own choice
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def check_master(master: str, log: object) -> None:
    """Warn when a multi-node job's master is a loopback address (fine only if every node is this host)."""
    try:
        resolved = socket.gethostbyname(master)
    except OSError:
        return
    if resolved.startswith("127."):
        log.warning("MASTER_ADDR=%s is loopback (%s) but the job spans nodes: ranks on other hosts cannot reach "  # type: ignore[attr-defined]
                    "it; start torchrun on node 0 with --local-addr <its routable address> (or make its host "
                    "name resolve to that address)", master, resolved)
