"""Two hosts on one machine: network namespaces joined by a veth pair, two ranks in each, a real
rendezvous over the veth addresses and gloo traffic between them: under torchrun --nnodes 2 (c10d), and
under mpirun with a hostfile of the two addresses (its ssh replaced by `ip netns exec`).

Needs root and `ip netns` (CI runs as root); skipped with the reason elsewhere. The namespaces are
removed whatever happens (deleting one removes its end of the veth pair, and so the pair).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.mpi.jobs import BIN, ROOT, free_port, job_env

pytestmark = pytest.mark.mpi

SUBNET = "10.231.{}.{}"


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs this test as root)"
    return None


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Two namespaces `a` and `b` with addresses 10.231.N.1 and .2 on a veth pair; removed afterwards."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    tag, net = f"fnp{os.getpid() % 100000}", os.getpid() % 250 + 1
    a, b = f"{tag}a", f"{tag}b"
    made = []
    try:
        for ns in (a, b):
            done = _ip("netns", "add", ns)
            if done.returncode != 0:
                pytest.skip(f"`ip netns add` is not permitted here: {done.stderr.strip()}")
            made.append(ns)
        steps = [(None, ("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")),
                 (None, ("link", "set", f"{tag}va", "netns", a)), (None, ("link", "set", f"{tag}vb", "netns", b))]
        for ns, end, host in ((a, "va", 1), (b, "vb", 2)):
            steps += [(ns, ("addr", "add", f"{SUBNET.format(net, host)}/24", "dev", f"{tag}{end}")),
                      (ns, ("link", "set", f"{tag}{end}", "up")), (ns, ("link", "set", "lo", "up"))]
        for ns, args in steps:
            done = _ip(*args, ns=ns)
            if done.returncode != 0:
                pytest.fail(f"ip {' '.join(args)} failed: {done.stderr}")
        yield {"a": a, "b": b, "addr_a": SUBNET.format(net, 1), "addr_b": SUBNET.format(net, 2),
               "veth_a": f"{tag}va", "veth_b": f"{tag}vb"}
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def _in(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def _bytes(ns: str, dev: str) -> int:
    out = subprocess.run(_in(ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"), capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def test_the_host_offers_its_veth_address_not_the_machines(hosts: dict[str, str]) -> None:
    """What rank 0 offers under mpirun across hosts (engine.execution.netaddr): inside namespace a only its
    veth address exists, whatever the machine's host name resolves to."""
    code = ("from engine.execution import netaddr; print(netaddr.candidates()); "
            f"print(netaddr.interface_of(netaddr.route_to('{hosts['addr_b']}')))")
    out = subprocess.run(_in(hosts["a"], sys.executable, "-c", code), capture_output=True, text=True, cwd=ROOT,
                         env=job_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"['{hosts['addr_a']}']", hosts["veth_a"]], out.stdout


def test_torchrun_on_two_hosts_meets_over_the_veth_and_matches_one_process(hosts: dict[str, str]) -> None:
    port = free_port()
    before = _bytes(hosts["a"], hosts["veth_a"]) + _bytes(hosts["b"], hosts["veth_b"])
    procs = []
    # both namespaces share the machine's host name, which resolves to neither veth address: each node says
    # which address is its own (--local-addr) and which one hosts the rendezvous (is_host), as on hosts
    # whose names do not resolve to their routable addresses
    for ns, addr, is_host in ((hosts["a"], hosts["addr_a"], 1), (hosts["b"], hosts["addr_b"], 0)):
        cmd = _in(ns, str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"{hosts['addr_a']}:{port}", "--rdzv-conf", f"is_host={is_host}",
                  "--local-addr", addr,
                  "--max-restarts", "0", "tests/mpi/netns_job.py")
        # stderr apart: torchrun's C++ warnings there could land inside a rank's OK line on a shared pipe
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            outs.append(stdout + "\n--- stderr ---\n" + stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    out = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), out[-20000:]
    ok = re.findall(r"^OK rank (\d) of 4 (\{.*?\}) iface (\S+) master (\S+)", out, flags=re.M)
    assert len(ok) == 8 and "FAIL" not in out, out[-20000:]
    for rank, _, iface, master in ok:  # ranks 0, 1 on host a; 2, 3 on host b
        assert iface == (hosts["veth_a"] if int(rank) < 2 else hosts["veth_b"]), out
        assert master == hosts["addr_a"], out
    sent = _bytes(hosts["a"], hosts["veth_a"]) + _bytes(hosts["b"], hosts["veth_b"]) - before
    assert sent > 20_000, f"only {sent} bytes crossed the veth pair"


AGENT = """#!/bin/sh
# mpirun's ssh stand-in: "host" is a veth address; run the daemon in that address's namespace, under its
# own host name (Open MPI tells nodes apart by name; the namespaces share the machine's otherwise)
host=$1; shift
case "$host" in
  {addr_a}) ns={a} ;;
  {addr_b}) ns={b} ;;
  *) echo "unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && $*"
"""


def test_mpirun_on_two_hosts_finds_the_veth_address_with_no_flags(hosts: dict[str, str], tmp_path: Path) -> None:
    """mpirun with a hostfile of the two veth addresses (its ssh replaced by `ip netns exec`): MPI's
    shared-memory communicator holds 2 of 4 ranks, so rank 0 offers its addresses, every rank probes them,
    and the job meets on the veth with gloo on it; nothing names an address or interface."""
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` (util-linux) to give each namespace its own host name")
    agent = tmp_path / "agent.sh"
    agent.write_text(AGENT.format(**hosts))
    agent.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{hosts['addr_a']} slots=2\n{hosts['addr_b']} slots=2\n")
    env = {k: v for k, v in job_env().items() if not k.startswith(("OMPI_COMM", "PMIX", "PMI_"))}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    inner = (f"hostname {hosts['a']} && exec {BIN / 'mpirun'} -n 4 --hostfile {hostfile} --prtemca plm_ssh_agent "
             f"{agent} --prtemca plm_ssh_no_tree_spawn 1 -x PYTHONPATH -x OMP_NUM_THREADS {sys.executable} "
             "tests/mpi/netns_job.py")
    before = _bytes(hosts["a"], hosts["veth_a"])
    done = subprocess.run(_in(hosts["a"], "unshare", "--uts", "sh", "-c", inner), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-20000:]
    ok = re.findall(r"^OK rank (\d) of 4 (\{.*?\}) iface (\S+)", out, flags=re.M)
    assert len(ok) == 8 and "FAIL" not in out, out[-20000:]
    assert {(int(r) // 2, iface) for r, _, iface in ok} == {(0, hosts["veth_a"]), (1, hosts["veth_b"])}, out
    assert _bytes(hosts["a"], hosts["veth_a"]) - before > 20_000
