"""``WAIT``: a write acknowledged by replicas before Fleet goes on (policy ``replica_acks`` /
``replica_ack_timeout_ms``; docs/guide/redis-cluster.md, "Failover and `replica_acks`").

``WAIT`` counts the writes of the connection it is sent on, so it must ride on the connection
that made them:

- on one node, in the same non-transactional pipeline (one connection) as the writes;
- on a Redis Cluster, down one connection of the master serving the written keys' slot
  (:func:`on_node`, the round trip :class:`OnNodes`: the writes grouped by master, each group
  with its ``WAIT``). redis-py's cluster pipeline cannot carry it: it would send the keyless
  ``WAIT`` to a node of its own choosing. ``OnNodes`` uses redis-py's cluster internals (the
  node of a key, a node's own connection, its slot-table patching), pinned by the tests on a
  real cluster (tests/cluster/test_replica_wait_cluster.py).

A ``WAIT`` that gets fewer replicas than asked (its timeout, or an error) is counted in
:class:`ReplicaAcks` and logged at most every ``SHORTFALL_LOG_EVERY_S``; the caller goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.cluster import PipelineCommand
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.policy import TurnsPolicy
from stores.roundtrips import Op

log = logging.getLogger("fleet.replicas")
SHORTFALL_LOG_EVERY_S = 10.0  # a replica away makes every WAIT short: one warning per this long

Command = tuple[Any, ...]  # ("XADD", key, ...): a command's name and arguments


@dataclass(frozen=True)
class ReplicaWait:
    """``WAIT replicas timeout_ms`` after a write, on the connection that made it."""

    replicas: int
    timeout_ms: int

    @classmethod
    def of(cls, policy: TurnsPolicy) -> ReplicaWait | None:
        """The policy's WAIT, or None when it asks for none (``replica_acks`` 0: no WAIT sent)."""
        if policy.durability.replica_acks <= 0:
            return None
        return cls(policy.durability.replica_acks, policy.durability.replica_ack_timeout_ms)


@dataclass
class ReplicaAcks:
    """What the WAITs of one store or client got, per operation (``acquire``, ``commit``, ``submit``).

    ``short``: WAITs that timed out with fewer replicas than asked (or failed): the write is
    on the master only, as if no WAIT had been asked; the caller went on."""

    waits: dict[str, int] = field(default_factory=dict)
    short: dict[str, int] = field(default_factory=dict)
    acked: dict[str, int] = field(default_factory=dict)  # replicas, summed
    logged_at: float = float("-inf")  # the clock's time of the last shortfall warning
    logged_short: int = 0  # shortfalls counted at that warning

    @classmethod
    def of(cls, *ops: str) -> ReplicaAcks:
        """Counters of ``ops``, each at 0."""
        return cls(dict.fromkeys(ops, 0), dict.fromkeys(ops, 0), dict.fromkeys(ops, 0))

    def count(self, op: str, wait: ReplicaWait, acked: Any, now: float) -> None:
        """Count one WAIT's reply ``acked`` (an int, or the exception it failed with); a
        shortfall is logged at most every ``SHORTFALL_LOG_EVERY_S`` of ``now``'s clock."""
        self.waits[op] = self.waits.get(op, 0) + 1
        got = acked if isinstance(acked, int) else 0  # a failed WAIT (e.g. unknown command) got none
        self.acked[op] = self.acked.get(op, 0) + got
        if got >= wait.replicas:
            return
        self.short[op] = self.short.get(op, 0) + 1
        total = sum(self.short.values())
        if now - self.logged_at >= SHORTFALL_LOG_EVERY_S:
            why = (f"failed: {acked}" if isinstance(acked, Exception)
                   else f"got {got} within {wait.timeout_ms} ms")
            log.warning("WAIT %d after %s %s; going on (the write is on the master only, a failover "
                        "may lose it); %d such shortfalls (%d since the last warning)", wait.replicas, op,
                        why, total, total - self.logged_short)
            self.logged_at, self.logged_short = now, total


def by_node(rc: Any, writes: Sequence[tuple[str, Command]]) -> dict[str, tuple[Any, list[int]]]:
    """``writes`` (key, command) grouped by the master serving each key: node name ->
    (node, indexes into ``writes``, in order)."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, (key, _cmd) in enumerate(writes):
        node = rc.get_node_from_key(key)
        groups.setdefault(node.name, (node, []))[1].append(i)
    return groups


@dataclass(frozen=True)
class OnNodes:
    """The round trip of a Cluster's ``writes`` (key, command) with their ``WAIT``: each master's
    share and then ``WAIT``, down one connection of that master. Its reply: the writes' replies
    (in the order of ``writes``; an error is its exception) and each master's WAIT reply.

    A MOVED reply patches the client's slot table (the caller's retry goes to the right
    master); a connection error has the client learn the topology again, and is raised."""

    writes: tuple[tuple[str, Command], ...]
    wait: ReplicaWait

    def send(self, rc: Any) -> tuple[list[Any], list[Any]]:
        """On the blocking Cluster client: master after master."""
        replies: list[Any] = [None] * len(self.writes)
        acked: list[Any] = []
        for node, idx in by_node(rc, self.writes).values():
            pipe = rc.get_redis_connection(node).pipeline(transaction=False)
            for i in idx:
                pipe.execute_command(*self.writes[i][1])
            pipe.wait(self.wait.replicas, self.wait.timeout_ms)
            try:
                got = pipe.execute(raise_on_error=False)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                rc.nodes_manager.initialize()  # what redis-py's own cluster commands do
                raise
            for i, res in zip(idx, got, strict=False):
                replies[i] = res
                if isinstance(res, MovedError):
                    rc.nodes_manager.move_slot(res)
            acked.append(got[-1])
        return replies, acked

    async def asend(self, rc: Any) -> tuple[list[Any], list[Any]]:
        """On the asyncio Cluster client: the masters' shares sent concurrently."""
        await rc.initialize()  # a no-op unless the client must learn the topology (again)
        replies: list[Any] = [None] * len(self.writes)

        async def one(node: Any, idx: list[int]) -> Any:
            cmds = [PipelineCommand(n, *self.writes[i][1]) for n, i in enumerate(idx)]
            cmds.append(PipelineCommand(len(idx), "WAIT", self.wait.replicas, self.wait.timeout_ms))
            try:
                await node.execute_pipeline(cmds)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                # what redis-py's own cluster commands do on a connection error
                rc.nodes_manager.move_node_to_end_of_cached_nodes(node.name)
                rc._initialize = True
                raise
            for i, cmd in zip(idx, cmds, strict=False):
                replies[i] = cmd.result
                if isinstance(cmd.result, MovedError):
                    await rc.nodes_manager.move_slot(cmd.result)
            return cmds[-1].result

        acked = await asyncio.gather(*(one(node, idx) for node, idx in by_node(rc, self.writes).values()))
        return replies, list(acked)


def on_node(writes: Sequence[tuple[str, Command]], wait: ReplicaWait) -> Op[tuple[list[Any], list[Any]]]:
    """Send ``writes`` on a Cluster client, each master's share followed by ``wait`` on the same
    connection (:class:`OnNodes`); the writes' replies and the WAITs' replies."""
    replies: tuple[list[Any], list[Any]] = yield OnNodes(tuple(writes), wait)
    return replies


def fewest(acked: Sequence[Any]) -> Any:
    """The WAIT reply of a write that went to several masters: the smallest count, or the
    first failure (the write is as durable as its least replicated part)."""
    failed = next((a for a in acked if not isinstance(a, int)), None)
    if failed is not None:
        return failed
    return min(acked) if acked else 0
