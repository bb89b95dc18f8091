"""Fleet's Lua as one Redis Functions library, and :class:`Functions`, the calls to it for
either kind of client.

``stores/lua`` holds one file per operation, each with its KEYS/ARGV header. :func:`library`
assembles them into the library ``fleet``: each file's text becomes the body of a local
function of ``(KEYS, ARGV)``, registered as ``fleet_<operation>_<version>``, and
``fleet_version`` returns :data:`VERSION`, a digest of those texts. A process runs only the
functions of its own version: after another version's library replaced it, its calls find
no function (nothing ran) instead of running Lua written for other arguments.

Runtime users only ``FCALL``; the library is loaded by an admin connection (:func:`install`:
``fleet install``, ``fleet up``). A call that finds no function waits for the library
(:func:`wait_for_library`: one line saying which version is needed, which was found and the
command that installs it, then a check every few seconds) and is sent again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.exceptions import ResponseError

from stores import cluster
from stores.roundtrips import Op, Single, is_async, operation

log = logging.getLogger("fleet.library")

LIBRARY = "fleet"
NAMES = ("lane_acquire", "lease_renew", "lease_drop", "turn_commit", "leader_acquire",
         "ledger_append", "lane_clear", "consumer_drop", "notification_ack",
         "notification_ack_covered", "notification_touch", "turn_submit", "submit_pressure",
         "user_delete", "dead_trim", "attempt_count", "group_record", "stream_append", "turn_cancel")
INSTALL_COMMAND = "fleet install"
CHECK_EVERY_S = float(os.environ.get("FLEET_LIBRARY_CHECK_S", "3"))  # how often a process
# waiting for the library looks again
_INCLUDE = re.compile(r"^-- @include (\w+)$", re.MULTILINE)


def resolve(name: str, read: Callable[[str], str]) -> str:
    """Operation ``name``'s text from ``read`` (a file's text by its path under ``stores/lua``),
    with each ``-- @include <part>`` line replaced by ``include/<part>.lua`` (a function two
    operations share)."""
    return _INCLUDE.sub(lambda m: read(f"include/{m.group(1)}.lua"), read(f"{name}.lua"))


@cache
def source(name: str) -> str:
    """The text of operation ``name`` as this version has it (:func:`resolve`)."""
    if name not in NAMES:
        raise KeyError(f"no Lua operation named {name!r}")
    lua = resources.files("stores").joinpath("lua")
    return resolve(name, lambda path: lua.joinpath(path).read_text())


def digest(sources: Mapping[str, str]) -> str:
    """The version of a library of ``sources`` (every operation's text)."""
    h = hashlib.sha1()
    for name in NAMES:
        h.update(f"{name}\0{sources[name]}\0".encode())
    return h.hexdigest()[:12]


VERSION = digest({name: source(name) for name in NAMES})


def function_name(op: str, version: str | None = None) -> str:
    """The name ``FCALL`` calls operation ``op`` by (this version's, unless ``version``)."""
    return f"fleet_{op}_{version or VERSION}"


def library(sources: Mapping[str, str] | None = None, version: str | None = None) -> str:
    """The library text: every operation of ``sources`` (by default the files'), as this
    version's function, and ``fleet_version``. With ``version``, another version's library
    beside this one's (``scripts/bench_lua_ab``): under a name of its own, without
    ``fleet_version``."""
    parts = [f"#!lua name={LIBRARY if version is None else f'{LIBRARY}_{version}'}\n"]
    for op in NAMES:
        body = (sources or {}).get(op) or source(op)
        parts.append(f"local function {op}(KEYS, ARGV)\n{body}\nend\n"
                     f"redis.register_function('{function_name(op, version)}', {op})\n")
    if version is None:
        parts.append("redis.register_function{function_name='fleet_version', "
                     f"callback=function() return '{VERSION}' end, flags={{'no-writes'}}}}\n")
    return "".join(parts)


def command(op: str, keys_: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
    """The ``FCALL`` of operation ``op`` (for calls queued as raw commands)."""
    return ("FCALL", function_name(op), len(keys_), *keys_, *args)


def is_missing(res: Any) -> bool:
    """Whether ``res`` (a reply or an error) says the function called is not there: no library
    or another version's (nothing ran)."""
    return isinstance(res, ResponseError) and "function not found" in str(res).lower()


# --- installing and checking ---------------------------------------------------------------
def install(r: Any) -> str:
    """Load the library (``FUNCTION LOAD REPLACE``) with an admin connection ``r``, a blocking
    client: on a Cluster on every primary. Returns the version loaded."""
    if cluster.is_cluster(r):  # every primary, named here; the replicas copy their primary's
        r.execute_command("FUNCTION LOAD", "REPLACE", library(), target_nodes=r.get_primaries())
    else:
        r.function_load(library(), replace=True)
    return VERSION


def state_of(found: str | None) -> str:
    """``ok``, ``missing`` or ``other version`` for the version a server reported."""
    if found is None:
        return "missing"
    return "ok" if found == VERSION else "other version"


def _found(res: Any) -> str | None:
    """The version ``FCALL_RO fleet_version`` returned (at most 64 characters: it is shown in
    a line), None when there is no library."""
    if is_missing(res):
        return None
    if isinstance(res, Exception):
        raise res
    return (res.decode(errors="replace") if isinstance(res, bytes) else str(res))[:64]


@operation
def library_state() -> Op[tuple[str, str | None]]:
    """``(state, version found)`` (see :func:`state_of`): ``FCALL_RO fleet_version``, on either
    kind of client."""
    try:
        res = yield Single(lambda r: r.fcall_ro("fleet_version", 0))
    except ResponseError as exc:
        res = exc
    found = _found(res)
    return state_of(found), found


class LibraryMissing(ResponseError):
    """Redis has not this version's functions library (nothing ran): for a caller that does not
    wait for it (a client's submit)."""


def missing_line() -> str:
    """What :class:`LibraryMissing` says."""
    return (f"Redis has not version {VERSION} of the Fleet functions library: install it with "
            f"`{INSTALL_COMMAND}` (an admin connection)")


def waiting_line(found: str | None) -> str:
    """The one line a process waiting for the library logs."""
    have = f"version {found} of the Fleet functions library" if found else "no Fleet functions library"
    return (f"Redis has {have}, this process needs version {VERSION}: install it with "
            f"`{INSTALL_COMMAND}` (an admin connection); waiting, checking again every {CHECK_EVERY_S:g} s")


class _Said:
    """Whether this process said it waits for the library: one line for all its waiting calls."""

    waiting = False

    @classmethod
    def missing(cls, found: str | None) -> None:
        if not cls.waiting:
            cls.waiting = True
            log.warning(waiting_line(found))

    @classmethod
    def back(cls) -> None:
        if cls.waiting:
            cls.waiting = False
            log.warning("the Fleet functions library version %s is installed: going on", VERSION)


_INTERRUPTED = threading.Event()  # set by interrupt_waits(): blocking waits give up


def interrupt_waits() -> None:
    """End every blocking wait for the library, now and later (a process told to stop: its
    waiting calls raise :class:`LibraryMissing`)."""
    _INTERRUPTED.set()


def wait_for_library(r: redis.Redis, stop: threading.Event | None = None) -> bool:
    """Return when the server holds this version's library (True), or ``stop`` is set first
    (False; without ``stop``, :func:`interrupt_waits`); until then, one line (for every call of
    the process waiting with this one) and a check every :data:`CHECK_EVERY_S`."""
    while (found := library_state(r))[0] != "ok":
        _Said.missing(found[1])
        if (stop or _INTERRUPTED).wait(CHECK_EVERY_S):
            return False
    _Said.back()
    return True


async def wait_for_library_async(r: Any) -> None:
    """:func:`wait_for_library` on an asyncio client."""
    while (found := await library_state(r))[0] != "ok":
        _Said.missing(found[1])
        await asyncio.sleep(CHECK_EVERY_S)
    _Said.back()


# --- calling -------------------------------------------------------------------------------
class Function:
    """Operation ``op`` bound to client ``r``: ``fn(keys=..., args=...)`` runs it (a coroutine
    on an asyncio client), waiting for the library when it is missing (on a blocking client,
    until :func:`interrupt_waits`: then :class:`LibraryMissing`); ``client=pipe`` queues the
    call on a pipeline instead (its caller reads the reply and handles a missing library)."""

    def __init__(self, r: Any, op: str) -> None:
        self.r = r
        self.op = op
        self._async_client = is_async(r)

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None) -> Any:
        cmd = command(self.op, keys, args)
        if client is not None:
            return client.execute_command(*cmd)
        if self._async_client:
            return self._async(cmd)
        while True:
            try:
                return self.r.execute_command(*cmd)
            except ResponseError as exc:
                if not is_missing(exc):
                    raise
            if not wait_for_library(self.r):
                raise LibraryMissing(missing_line())

    async def _async(self, cmd: tuple[Any, ...]) -> Any:
        while True:
            try:
                return await self.r.execute_command(*cmd)
            except ResponseError as exc:
                if not is_missing(exc):
                    raise
            await wait_for_library_async(self.r)


class Functions:
    """Every operation of the library, bound to client ``r`` (blocking or asyncio)."""

    lane_acquire: Function
    lease_renew: Function
    lease_drop: Function
    turn_commit: Function
    leader_acquire: Function
    ledger_append: Function
    lane_clear: Function
    consumer_drop: Function
    notification_ack: Function
    notification_ack_covered: Function
    notification_touch: Function
    turn_submit: Function
    submit_pressure: Function
    user_delete: Function
    dead_trim: Function
    attempt_count: Function
    group_record: Function
    stream_append: Function
    turn_cancel: Function

    def __init__(self, r: Any) -> None:
        for name in NAMES:
            setattr(self, name, Function(r, name))


async def resend_missing(replies: list[Any], r: Any,
                         again: Callable[[list[int]], Awaitable[list[Any]]]) -> list[Any]:
    """``replies`` of a pipeline of calls, where those that found no function (nothing ran) are
    sent again (``again(indexes)`` returns their new replies) once the library is back."""
    while missing := [i for i, res in enumerate(replies) if is_missing(res)]:
        await wait_for_library_async(r)
        for i, res in zip(missing, await again(missing), strict=True):
            replies[i] = res
    return replies
