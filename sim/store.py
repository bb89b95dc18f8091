"""The simulated Redis: fakeredis running Fleet's real functions library, behind a faulty network.

Every client is a real ``redis.asyncio.Redis`` (pipelines,
the retry machinery and reply parsing are redis-py's own), whose connections talk to one
in-process ``fakeredis.FakeServer``. What a real network and server add, this module adds:

- **latency**: every command waits a seeded virtual delay before it reaches the server and
  again before its reply comes back, so commands of different nodes interleave;
- **lost replies**: a command reaches the server and is applied, the reply never arrives
  (the client sees a connection error and redis-py retries, as it would);
- **restarts**: the server goes away for a while and comes back with its data (AOF with
  ``appendfsync always``), the functions library among it: every connection breaks, blocked
  commands are dropped;
- **killed clients**: a SIGKILLed process's blocked commands die with its sockets, while a
  paused (SIGSTOPped) process's blocked read is still served by the server and read later;
- **stalls**: a reply held up for a while (a slow network, a server busy elsewhere);
- **dropped cancellations**: a cancellation that lands in the client library's call is lost
  and the call goes on (CPython gh-86296: 3.11's ``wait_for`` returns the inner result when
  both end in one step), as redis-py's calls may do.

Blocked commands run server-side (node ``None``), so a paused node still gets deliveries.

Every connection attempt and every command the server runs is shown to the network's
``watchers`` as a :class:`Wire` event (``sim.scenario`` injects faults at such events).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fakeredis
import redis.asyncio as aioredis
from fakeredis._clients._async import FakeAsyncRedisConnection, FakeReader, FakeWriter
from fakeredis._helpers import NoResponse
from fakeredis._socket import AsyncFakeSocket
from redis.exceptions import ConnectionError as RedisConnectionError

from sim.loop import NODE
from stores.connection import async_retry_options
from stores.functions import NAMES, function_name, library, source

_SERVER_CTX = contextvars.Context()  # blocked commands run here: on the server, not the client

# Bugs planted in the Lua the simulated server runs, to show the checks find them: operation
# name -> the text to run instead (a test sets it, e.g. with monkeypatch.setitem). The server's
# library holds the planted text under the real function's name and version.
PLANTED: dict[str, Callable[[str], str]] = {}


def _install(server: fakeredis.FakeServer) -> None:
    """Load the library, with the planted operations, as ``fleet install`` would."""
    planted = {name: plant(source(name)) for name, plant in PLANTED.items()}
    fakeredis.FakeRedis(server=server).function_load(library(planted), replace=True)


@dataclass(frozen=True)
class Wire:
    """What the network saw: a node's ``connect`` attempt (it fails while Redis is away), or a
    command the server ``applied`` (its effects are in the store; its ``reply``, as the server
    sent it, not yet read by the client), or ``queued`` inside a ``MULTI`` (applied at ``EXEC``)."""

    kind: str
    node: str | None
    args: tuple[bytes, ...] = ()
    reply: Any = None

    @property
    def command(self) -> str:
        return self.args[0].decode(errors="replace").upper() if self.args else ""

    def script(self) -> str | None:
        """The name of the Fleet Lua operation this ``FCALL`` runs, if it runs one."""
        if self.command not in ("FCALL", "FCALL_RO") or len(self.args) < 3:
            return None
        return _SCRIPT_OF.get(self.args[1])

    def script_keys(self) -> list[str]:
        """A script call's KEYS."""
        if self.script() is None:
            return []
        return [k.decode(errors="replace") for k in self.args[3:3 + int(self.args[2])]]

    def script_argv(self) -> list[bytes]:
        """A script call's ARGV."""
        return list(self.args[3 + int(self.args[2]):]) if self.script() else []


_SCRIPT_OF = {function_name(name).encode(): name for name in NAMES}  # an operation by its function


class _OrderedCallbacks:
    """fakeredis keeps its blocked-client callbacks in a set: iteration order would follow
    memory addresses and break replay. This keeps them in insertion order."""

    def __init__(self) -> None:
        self._d: dict[Any, None] = {}

    def add(self, cb: Any) -> None:
        self._d[cb] = None

    def remove(self, cb: Any) -> None:
        del self._d[cb]

    def discard(self, cb: Any) -> None:
        self._d.pop(cb, None)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._d))

    def __len__(self) -> int:
        return len(self._d)


class Network:
    """The seeded network and server of one schedule: latencies, lost replies, restarts."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rng: random.Random, *,
                 latency_ms: tuple[float, float] = (0.05, 1.0), spike_ms: float = 20.0,
                 spike_rate: float = 0.02) -> None:
        self.loop = loop
        self.rng = rng
        self.server = fakeredis.FakeServer()
        _install(self.server)
        self.server.dbs[0]._change_callbacks = _OrderedCallbacks()  # type: ignore[assignment]
        self.latency_ms = latency_ms
        self.spike_ms = spike_ms
        self.spike_rate = spike_rate
        self.generation = 0  # bumped by every restart: older connections are broken
        self.down_until = -1.0
        self.drop_next: set[str] = set()  # nodes whose next reply is lost
        self.stall_next: dict[str, float] = {}  # node -> seconds its next reply is held up
        self.lose_cancel: set[str] = set()  # nodes whose next cancellation inside a connect is lost
        self.cancels_lost = 0
        self.watchers: list[Callable[[Wire], None]] = []
        self.commands = 0
        self._sockets: list[weakref.ref[SimSocket]] = []  # in connect order (a WeakSet's is not fixed)

    def delay(self) -> float:
        """One leg of a round trip, in seconds: mostly short, sometimes a spike."""
        if self.rng.random() < self.spike_rate:
            return self.rng.uniform(1.0, self.spike_ms) / 1000
        return self.rng.uniform(*self.latency_ms) / 1000

    def saw(self, kind: str, node: str | None, args: tuple[bytes, ...] = (), reply: Any = None) -> None:
        """Show an event to the watchers."""
        for watch in list(self.watchers):
            watch(Wire(kind, node, args, reply))

    def is_down(self) -> bool:
        return self.loop.time() < self.down_until

    def restart(self, down_s: float) -> None:
        """The server dies now and is back ``down_s`` later, with its data and its functions."""
        self.generation += 1
        self.down_until = self.loop.time() + down_s
        for sock in self._live_sockets():
            sock.abort_blocked()

    def _live_sockets(self) -> list[SimSocket]:
        self._sockets = [ref for ref in self._sockets if ref() is not None]
        return [sock for ref in self._sockets if (sock := ref()) is not None]

    def kill_node(self, node: str) -> None:
        """A SIGKILLed process: its sockets close, so its blocked commands end unserved."""
        for sock in self._live_sockets():
            if sock.node == node:
                sock.abort_blocked()

    def client(self, *, retries: int = 8) -> aioredis.Redis:
        """An asyncio client of this server, with production's retry options."""
        net = self

        class _Conn(SimConnection):
            network = net

        client = fakeredis.FakeAsyncRedis(server=self.server, connection_class=_Conn)
        # fakeredis hands its connections none of the client's retry options (only a fixed set of
        # keywords): its connections would not retry at all, where production's retry a broken
        # connection on a fresh one. Give them production's, before the first is made.
        client.connection_pool.connection_kwargs.update(async_retry_options(retries))
        return client

    def sync_client(self) -> fakeredis.FakeRedis:
        """A direct client for the checker and setup: no latency, no faults."""
        return fakeredis.FakeRedis(server=self.server)


class SimSocket(AsyncFakeSocket):
    """fakeredis' socket, with blocked commands run server-side and abortable."""

    def __init__(self, *args: Any, node: str | None = None, network: Network | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.node = node
        self.network = network
        self.block_task: asyncio.Task[None] | None = None

    def _process_command(self, fields: list[bytes]) -> None:
        queued = self._transaction is not None and bool(fields) and \
            fields[0].lower() not in (b"exec", b"discard", b"multi", b"watch")
        self._reply: Any = None
        super()._process_command(fields)
        if self.network is not None and self.network.watchers and fields:
            self.network.saw("queued" if queued else "applied", self.node, tuple(bytes(f) for f in fields),
                             self._reply)

    def put_response(self, msg: Any) -> None:
        self._reply = msg
        super().put_response(msg)

    def _blocking(self, timeout: float | None, func: Any, shape: Any = None) -> Any:
        # as AsyncFakeSocket._blocking, but the waiting task belongs to the server
        loop = asyncio.get_running_loop()
        ret = func(True)
        if ret is not None or self._in_transaction:
            return ret if shape is None else shape(ret)
        event = asyncio.Event()

        def callback() -> None:
            loop.call_soon_threadsafe(event.set, context=_SERVER_CTX)

        self._db.add_change_callback(callback)
        self._blocked = True
        self.pause()
        self.block_task = _SERVER_CTX.run(
            loop.create_task, self._async_blocking(timeout, func, event, callback, shape))
        return NoResponse()

    def abort_blocked(self) -> None:
        """The connection broke: a blocked command ends unserved, the reader sees the break."""
        if self.block_task is not None and not self.block_task.done():
            self.block_task.cancel()
            self.put_response(RedisConnectionError("simulated connection loss"))


class SimConnection(FakeAsyncRedisConnection):
    """A connection with latency, lost replies and restarts (see the module doc)."""

    network: Network

    async def _connect(self) -> None:
        net = self.network
        node = NODE.get()
        net.saw("connect", node)
        if node is not None and node in net.lose_cancel:
            await self._lossy_wait(node)
        if net.is_down():
            raise RedisConnectionError("simulated Redis is down")
        self._sock = SimSocket(self._server, self.db, client_class=self._client_class,
                               lua_modules=self._lua_modules, client_info=self._client_info,
                               node=node, network=net)
        net._sockets.append(weakref.ref(self._sock))
        self._generation = net.generation
        self._reader = FakeReader(self._sock)
        self._writer = FakeWriter(self._sock)

    async def _lossy_wait(self, node: str) -> None:
        """A round trip inside the library in which a cancellation is lost: the task is left
        cancelled-but-running, as 3.11's ``wait_for`` leaves it (no ``uncancel``)."""
        net = self.network
        try:
            await asyncio.sleep(net.delay())
        except asyncio.CancelledError:
            net.lose_cancel.discard(node)
            net.cancels_lost += 1

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        net = self.network
        try:
            await asyncio.sleep(net.delay())
        except BaseException:
            # cancelled on the way out, as redis-py's own send may be: the connection is dropped,
            # or a command sent before this one (the handshake's) would leave its reply behind
            await self.disconnect(nowait=True)
            raise
        if self.is_connected:  # one dropped is connected afresh by the send, as redis-py's is
            self._check_alive()
        await super().send_packed_command(command, check_health)
        net.commands += 1
        node = NODE.get()
        self._lose_reply = node is not None and node in net.drop_next
        if self._lose_reply:
            net.drop_next.discard(node)
        self._stall = net.stall_next.pop(node, 0.0) if node is not None else 0.0

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        response = await super().read_response(*args, **kwargs)
        stall, self._stall = getattr(self, "_stall", 0.0), 0.0
        try:
            await asyncio.sleep(self.network.delay() + stall)
        except BaseException:
            # cancelled between two replies of a pipeline: the rest must not be read as the
            # replies of the next command (redis-py guards its own reads the same way)
            await self.disconnect(nowait=True)
            raise
        if isinstance(response, RedisConnectionError):
            await self.disconnect()
            raise response
        if getattr(self, "_lose_reply", False):
            self._lose_reply = False
            await self.disconnect()
            raise RedisConnectionError("simulated lost reply")
        self._check_alive()
        return response

    def _check_alive(self) -> None:
        net = self.network
        if net.is_down() or getattr(self, "_generation", net.generation) != net.generation:
            self._sock = None
            self._reader = None
            self._writer = None
            raise RedisConnectionError("simulated Redis restart: connection lost")
