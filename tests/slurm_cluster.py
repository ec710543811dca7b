"""A real Slurm cluster on this one host, for the tests marked ``slurm``.

Debian's packages (``slurm-wlm``, ``munge``; installed here when missing, which needs root
and apt-get), run in the foreground as children of the test session: ``munged`` (as the
munge user, on a socket of its own), ``slurmctld`` and one ``slurmd`` per node. Two nodes,
``n1`` and ``n2``, both on this host: Debian builds slurmd with multiple-slurmd support
(``slurmd -N NAME``), so each node is a slurmd on a port of its own and a job of
``--nodes 2`` runs one task on each, as on two machines.

Nothing outside the cluster's directory is written (the packages aside): the configuration,
state, spool and logs live there, and the daemons listen on free ports, so a Slurm the host
may already run is left alone.

Example usage::

    with cluster(Path("/tmp/slurm-test")) as env:   # env: SLURM_CONF for sbatch & co.
        subprocess.run(["sbatch", "--wrap", "hostname"], env=os.environ | env, check=True)

Known limitations: no accounting database (``sacct`` answers "Slurm accounting storage is
disabled"), no cgroups (``proctrack/linuxproc``, ``task/none``): jobs are followed with
``scontrol show job``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "runuser")
NODES = ("n1", "n2")
START_TIMEOUT_S = 60


def unavailable_reason() -> str | None:
    """Why this host cannot bring up the cluster (None when it can)."""
    if os.geteuid() != 0:
        return f"the slurm tests start Slurm's daemons (slurmd runs as root); this is uid {os.geteuid()}"
    if not all(shutil.which(c) for c in COMMANDS) and shutil.which("apt-get") is None:
        return f"Slurm is not installed and there is no apt-get to install {' '.join(PACKAGES)}"
    return None


def install() -> None:
    """``apt-get install slurm-wlm munge`` unless their commands are there already."""
    if all(shutil.which(c) for c in COMMANDS):
        return
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    for args in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        proc = subprocess.run(args, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")


def free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def slurm_conf(root: Path, *, ctld_port: int, node_ports: list[int], munge_socket: Path) -> str:
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} CPUs={os.cpu_count()} State=UNKNOWN"
        for name, port in zip(NODES, node_ports)
    )
    return f"""ClusterName=memplan-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
# no cgroups in a container: processes tracked by parent pid, tasks not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# no slurmdbd: jobs are followed with scontrol, which keeps an ended job MinJobAge seconds
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
# both nodes declare this host's CPUs (what each slurmd finds would be the same CPUs)
SlurmdParameters=config_overrides
# seconds between a cancelled or timed-out job's SIGTERM and its SIGKILL (default 30)
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _wait_idle(env: dict, procs: list[subprocess.Popen], root: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a Slurm daemon exited at start-up: {dead}; logs in {root}")
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True)
        states = dict(line.split() for line in sinfo.stdout.splitlines())
        if sorted(states) == sorted(NODES) and set(states.values()) == {"idle"}:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Slurm nodes did not turn idle in {START_TIMEOUT_S} s; logs in {root}")


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and the nodes' slurmd in ``root``; yield the environment the
    Slurm commands need (``SLURM_CONF``); stop them all on the way out."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # munged, as the munge user, reaches its socket through it
    munge_dir = root / "munge"
    munge_dir.mkdir()
    munge_dir.chmod(0o755)  # munged wants its socket's directory open to all, writable by it only
    shutil.chown(munge_dir, "munge", "munge")
    munge_socket = munge_dir / "munge.socket"
    ctld_port, *node_ports = free_ports(1 + len(NODES))
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, ctld_port=ctld_port, node_ports=node_ports, munge_socket=munge_socket))
    env = os.environ | {"SLURM_CONF": str(conf)}
    munged = [
        "runuser",
        "-u",
        "munge",
        "--",
        "munged",
        "--foreground",
        f"--socket={munge_socket}",
        f"--pid-file={munge_dir}/munged.pid",
        f"--log-file={munge_dir}/munged.log",
        f"--seed-file={munge_dir}/munged.seed",
    ]
    daemons = [munged, ["slurmctld", "-D", "-f", str(conf)]] + [
        ["slurmd", "-D", "-f", str(conf), "-N", name] for name in NODES
    ]
    procs: list[subprocess.Popen] = []
    try:
        for args in daemons:
            with open(root / f"{args[0]}-{len(procs)}.stderr", "w") as stderr:
                procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=stderr))
            if args is munged:
                _wait_for(munge_socket, procs[-1], root)
        _wait_idle(env, procs, root)
        yield {"SLURM_CONF": str(conf)}
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for(path: Path, proc: subprocess.Popen, root: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"munged made no socket at {path} in {START_TIMEOUT_S} s; logs in {root}")
        time.sleep(0.1)
