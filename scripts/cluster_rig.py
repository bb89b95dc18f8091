"""A real Redis Cluster of ``redis-server`` processes on free loopback ports: 3 masters +
3 replicas by default (``start_cluster``; any number of masters, fewer than 3 set up by hand),
or one plain node with the same settings (``start_single``), every process started and stopped
by pid; never the machine's 6379. A master can be SIGKILLed (``kill_master``), its replica's promotion
awaited (``wait_promoted``) and the killed node started again (``heal``: it rejoins as a
replica); a node can be paused (``pause``/``resume``, SIGSTOP/SIGCONT).

Used by the cluster tests (tests/cluster/conftest.py re-exports it) and by
``scripts/chaos --cluster``.

Every node runs the same ACL file (``--aclfile``, Fleet's roles of ``protocol.acl``): its
default user is the admin, with ``admin_password``, which the rig's own clients, the replicas
(``masterauth``) and ``redis-cli --cluster create`` use; a Fleet process connects as its role
(``role_url``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import redis

NODE_TIMEOUT_MS = 1000  # how long a master may be silent before its replica takes over


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port(taken: set[int]) -> int:
    """A free loopback port whose cluster bus port (+10000) is free too and below 65536.

    (``tests.conftest.free_port`` hands out ephemeral ports, up to 60999: +10000 can overflow.)
    """
    for _ in range(1000):
        port = random.randint(20_000, 45_000)
        if port not in taken and port + 10_000 not in taken and _bindable(port) and _bindable(port + 10_000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass(frozen=True)
class Tls:
    """A CA and the certificate (with its key) every node presents."""

    ca: Path
    cert: Path
    key: Path


@dataclass
class ClusterNode:
    """One redis-server of the cluster."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    node_timeout_ms: int = NODE_TIMEOUT_MS
    tls: Tls | None = None  # TLS only: clients, replication and the cluster bus
    aclfile: Path | None = None  # the roles' ACL file, the same for every node
    admin_password: str | None = None  # the default user's (the admin's) password in it
    cluster: bool = True  # False: a plain redis-server with the same settings (``start_single``)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout: float = 2.0) -> redis.Redis:
        """The admin's client of this node."""
        if self.tls is not None:
            return redis.Redis(port=self.port, socket_connect_timeout=timeout, socket_timeout=timeout,
                               password=self.admin_password, ssl=True, ssl_ca_certs=str(self.tls.ca))
        return redis.Redis(port=self.port, socket_connect_timeout=timeout, socket_timeout=timeout,
                           password=self.admin_password)

    @property
    def role(self) -> str:
        """``master`` or ``slave`` (what the node says now), ``down`` if it is not running."""
        if not self.alive:
            return "down"
        with self.client() as c:
            return str(c.info("replication")["role"])

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary
        if self.tls is None:
            listen = ["--port", str(self.port)]
        else:  # the cluster bus and replication over TLS too: nothing in clear
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                      "--tls-auth-clients", "no", "--tls-cluster", "yes", "--tls-replication", "yes"]
        args = [binary, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf"),
                     "--cluster-node-timeout", str(self.node_timeout_ms),
                     # a replica may take over however long it was cut off (tests kill at any time)
                     "--cluster-replica-validity-factor", "0"]
        if self.aclfile is not None:
            args += ["--aclfile", str(self.aclfile)]
        if self.admin_password is not None:  # a replica syncs from its master as the admin
            args += ["--masteruser", "default", "--masterauth", self.admin_password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        with self.client(0.2) as c:
            while True:
                try:
                    if c.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise RuntimeError(f"cluster node on port {self.port} did not start") from None
                    time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, by pid."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP, by pid (``resume`` sends the SIGCONT)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)  # a paused node cannot act on its SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


@dataclass
class RedisClusterRig:
    """The cluster of a test session: ``url`` of one node, ``nodes`` with pid, port and role."""

    nodes: list[ClusterNode]
    passwords: dict[str, str] = field(default_factory=dict)  # role -> password (the ACL file's)
    started_in_s: float = 0.0
    killed: list[ClusterNode] = field(default_factory=list)
    _replicas_at_kill: dict[int, list[ClusterNode]] = field(default_factory=dict)
    offset_at_kill: dict[int, int] = field(default_factory=dict)  # port -> master_repl_offset just before

    @property
    def url(self) -> str:
        """The admin's URL of one live node (a master if there is one alive): ``rediss://``
        with the CA on a TLS cluster."""
        return self._url(self.masters()[0], "default", self.nodes[0].admin_password)

    @property
    def plain_url(self) -> str:
        """``url`` without credentials (a process given its role's password apart)."""
        return self._url(self.masters()[0])

    def role_url(self, role: str) -> str:
        """The URL of ACL role ``role`` (``fleet-worker``, …) on one live node."""
        return self._url(self.masters()[0], role, self.passwords.get(role))

    def urls(self) -> list[str]:
        """The admin's URL of every live node."""
        return [self._url(n, "default", n.admin_password) for n in self.nodes if n.alive]

    @staticmethod
    def _url(node: ClusterNode, user: str | None = None, password: str | None = None) -> str:
        auth = "" if password is None else f"{quote(user or 'default', safe='')}:{quote(password, safe='')}@"
        if node.tls is None:
            return f"redis://{auth}127.0.0.1:{node.port}/0"
        return f"rediss://{auth}127.0.0.1:{node.port}/0?ssl_ca_certs={node.tls.ca}"

    def masters(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive and n.role == "master"]

    def replicas(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive and n.role == "slave"]

    def master_of_slot(self, slot: int) -> ClusterNode:
        """The node serving ``slot`` now (asked of a node, not of a client's cache)."""
        with self.masters()[0].client() as c:
            for lo, hi, master, *_replicas in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise LookupError(f"no master serves slot {slot}")

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        with master.client() as c:
            my_id = c.execute_command("CLUSTER", "MYID").decode()
        out = []
        for node in self.replicas():
            with node.client() as c:
                for line in c.execute_command("CLUSTER", "NODES").decode().splitlines():
                    parts = line.split()
                    if "myself" in parts[2] and parts[3] == my_id:
                        out.append(node)
        return out

    def kill_master(self, master: ClusterNode | None = None, lag_s: float = 0.0,
                    while_lagging: Callable[[], object] | None = None) -> ClusterNode:
        """SIGKILL a master (by pid); returns it. Its replica is promoted within a few seconds:
        ``wait_promoted`` waits for that. ``lag_s``: its replicas are paused (SIGSTOP) that long
        before the kill and resumed (SIGCONT) right after it, so they fall behind: what the
        master acknowledged meanwhile and had not handed to the kernel is lost with it.
        ``while_lagging`` runs once they are paused (writes that the failover is to lose)."""
        master = master or self.masters()[0]
        assert master.role == "master", f"port {master.port} is not a master"
        replicas = self.replicas_of(master)
        assert replicas, f"master on port {master.port} has no replica to promote"
        self._replicas_at_kill[master.port] = replicas
        try:
            if lag_s > 0:
                for replica in replicas:
                    replica.pause()
                if while_lagging is not None:
                    while_lagging()
                time.sleep(lag_s)
            with master.client() as c:
                self.offset_at_kill[master.port] = int(c.info("replication")["master_repl_offset"])
            master.kill()
        finally:
            if lag_s > 0:
                for replica in replicas:
                    replica.resume()
        self.killed.append(master)
        return master

    def wait_promoted(self, killed: ClusterNode, timeout: float = 30.0) -> ClusterNode:
        """Wait until a replica of ``killed`` is a master and the cluster is ok; return it."""
        candidates = self._replicas_at_kill[killed.port]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            promoted = [n for n in candidates if n.alive and n.role == "master"]
            if promoted and self._all_ok():
                return promoted[0]
            time.sleep(0.1)
        raise TimeoutError(f"no replica of port {killed.port} was promoted within {timeout:g} s")

    def stream_lost(self, killed: ClusterNode, promoted: ClusterNode) -> int | None:
        """Bytes of the killed master's replication stream its promoted replica never got (at
        least: the master's offset is read just before the SIGKILL), from the offset the replica
        had when it took over (``second_repl_offset`` - 1). None if unknown."""
        try:
            with promoted.client() as c:
                took_over_at = int(c.info("replication")["second_repl_offset"]) - 1
        except (redis.RedisError, KeyError, ValueError):
            return None
        before = self.offset_at_kill.get(killed.port)
        return None if before is None or took_over_at < 0 else max(0, before - took_over_at)

    def heal(self, timeout: float = 30.0) -> None:
        """Start the killed nodes again (each rejoins as a replica) and wait until all is ok."""
        for node in self.killed:
            node.start()
        self.killed.clear()
        deadline = time.monotonic() + timeout
        while not (self._all_ok() and len(self.masters()) == 3 and len(self.replicas()) == 3
                   and all(self._replica_linked(n) for n in self.replicas())):
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not heal")
            time.sleep(0.1)

    def flush(self) -> None:
        """FLUSHALL on every master."""
        for node in self.masters():
            with node.client() as c:
                c.flushall()

    def _all_ok(self) -> bool:
        alive = [n for n in self.nodes if n.alive]
        try:
            for node in alive:
                with node.client() as c:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    if "cluster_state:ok" not in info:
                        return False
                    # every live node must agree that all slots are served
                    if "cluster_slots_ok:16384" not in info:
                        return False
        except redis.RedisError:
            return False
        return True

    @staticmethod
    def _replica_linked(node: ClusterNode) -> bool:
        with node.client() as c:
            return str(c.info("replication").get("master_link_status")) == "up"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def install_library(rig: RedisClusterRig) -> None:
    """Fleet's functions library on every master, as the admin (``fleet install``); the
    replicas get it from their masters."""
    from stores import functions

    for node in rig.masters():
        client = node.client()
        try:
            functions.install(client)
        finally:
            client.close()


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The slots of ``masters`` masters as ``redis-cli --cluster create`` deals them: contiguous
    ranges of 16384 / ``masters`` slots (the remainder spread one each over the first ranges)."""
    out, lo = [], 0
    for i in range(masters):
        size = 16384 // masters + (1 if i < 16384 % masters else 0)
        out.append((lo, lo + size - 1))
        lo += size
    return out


def _create_by_hand(masters: list[ClusterNode], replicas: list[ClusterNode], timeout: float = 30.0) -> None:
    """A cluster of fewer than 3 masters (``redis-cli --cluster create`` refuses one): the
    masters take even slot ranges, every node meets the first, and the replicas are dealt
    round-robin to the masters once they know them."""
    first = masters[0]
    for node, (lo, hi) in zip(masters, slot_ranges(len(masters)), strict=True):
        with node.client() as c:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
    for node in [*masters[1:], *replicas]:
        with node.client() as c:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.port + 10_000)
    ids = []
    for node in masters:
        with node.client() as c:
            ids.append(c.execute_command("CLUSTER", "MYID").decode())
    for i, node in enumerate(replicas):
        master_id = ids[i % len(ids)]
        deadline = time.monotonic() + timeout
        with node.client() as c:
            while master_id not in c.execute_command("CLUSTER", "NODES").decode():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node on port {node.port} never learnt of master {master_id}")
                time.sleep(0.05)
            c.execute_command("CLUSTER", "REPLICATE", master_id)


def start_single(workdir: Path, admin_password: str | None = None) -> RedisClusterRig:
    """One plain redis-server (no cluster) with the cluster nodes' settings, Fleet's library
    installed, as a rig of one node (``url``, ``masters``, ``stop`` as for a cluster)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = cluster_port(set())
    node = ClusterNode(port=port, workdir=workdir, admin_password=admin_password, cluster=False)
    return _started(RedisClusterRig(nodes=[node]), node.start, time.monotonic())


def _started(rig: RedisClusterRig, start: Callable[[], None], began: float) -> RedisClusterRig:
    """``rig`` once ``start`` brought its nodes up and Fleet's library is installed (since
    ``began``); stopped if either failed."""
    try:
        start()
        install_library(rig)
    except BaseException:
        rig.stop()
        raise
    rig.started_in_s = time.monotonic() - began
    return rig


def start_cluster(workdir: Path, masters: int = 3, replicas_per_master: int = 1,
                  node_timeout_ms: int = NODE_TIMEOUT_MS, tls: Tls | None = None,
                  passwords: dict[str, str] | None = None,
                  admin_password: str | None = None) -> RedisClusterRig:
    """``masters`` masters with ``replicas_per_master`` replicas each, Fleet's library installed.
    With ``passwords`` (every role's) and ``admin_password``, every node runs the roles' ACL file
    (RQ's rights too, as on the tests' single servers); without, no ACL (every client the admin)."""
    from protocol.acl import acl_file

    began = time.monotonic()
    taken: set[int] = set()
    aclfile = None
    if passwords is not None:
        assert admin_password is not None, "an ACL file needs the admin's password"
        workdir.mkdir(parents=True, exist_ok=True)
        aclfile = workdir / "users.acl"
        aclfile.write_text(acl_file(passwords, default=admin_password, shared_with_rq=True))
    nodes = []
    for i in range(masters * (1 + replicas_per_master)):
        port = cluster_port(taken)
        taken |= {port, port + 10_000}
        node_dir = workdir / f"node-{i}"
        node_dir.mkdir(parents=True)
        nodes.append(ClusterNode(port=port, workdir=node_dir, node_timeout_ms=node_timeout_ms, tls=tls,
                                 aclfile=aclfile, admin_password=admin_password))
    rig = RedisClusterRig(nodes=nodes, passwords=dict(passwords or {}))

    def start() -> None:
        for node in nodes:
            node.start()
        if masters >= 3:
            cli = shutil.which("redis-cli")
            assert cli
            secure = [] if tls is None else ["--tls", "--cacert", str(tls.ca)]
            # the password in the environment, not on the command line (ps shows that)
            cli_env = {**os.environ, "REDISCLI_AUTH": admin_password} if admin_password is not None else None
            subprocess.run([cli, *secure, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                            "--cluster-replicas", str(replicas_per_master), "--cluster-yes"],
                           env=cli_env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=60)
        else:  # redis-cli --cluster create refuses fewer than 3 masters
            _create_by_hand(nodes[:masters], nodes[masters:])
        deadline = time.monotonic() + 30
        while not (rig._all_ok() and len(rig.masters()) == masters
                   and all(rig._replica_linked(n) for n in rig.replicas())
                   and len(rig.replicas()) == masters * replicas_per_master):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
    return _started(rig, start, began)
