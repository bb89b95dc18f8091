"""Store operations written once, sent by a blocking or an asyncio client.

An operation that both kinds of client need is a generator: it yields one round trip at a
time and receives its replies (or, thrown in, its error), then returns its result. It sends
nothing itself, so :func:`run` (a blocking ``redis.Redis``, ``RedisCluster`` or
``fakeredis.FakeRedis``) and :func:`arun` (their asyncio counterparts) execute the same code, and
each ``yield`` is one round trip to read and to count.

A round trip is :class:`Pipelined` (commands queued on one pipeline), :class:`Single` (one
command on the client itself), or ``stores.replicas.OnNodes`` (a Cluster's writes with their
``WAIT``, per master). Decorated with :func:`operation`, a generator becomes a function of the
client: ``read_policy(r, tier)`` returns the result on a blocking client, and a coroutine to
await on an asyncio one; another operation runs it inline with ``yield from read_policy.steps(tier)``.
:func:`run_all` runs several side by side, their pipelined round trips sent together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, overload

import redis
import redis.asyncio as aioredis

P = ParamSpec("P")
T = TypeVar("T")


class RoundTrip(Protocol):
    """One round trip, as it goes out on each kind of client."""

    def send(self, r: Any) -> Any:
        """Send it on a blocking client; its reply."""
        ...

    async def asend(self, r: Any) -> Any:
        """Send it on an asyncio client; its reply."""
        ...


Op = Generator[RoundTrip, Any, T]  # yields round trips, receives their replies, returns a T


@dataclass(frozen=True)
class Pipelined:
    """The commands ``queue`` puts on one pipeline (queueing is the same on either kind of
    pipeline); the reply is ``execute``'s list. ``raise_on_error=False`` puts a command's error
    in the list instead of raising it."""

    queue: Callable[[Any], object]
    transaction: bool = False
    raise_on_error: bool = True

    def send(self, r: Any) -> Any:
        pipe = r.pipeline(transaction=self.transaction)
        self.queue(pipe)
        return pipe.execute(raise_on_error=self.raise_on_error)

    async def asend(self, r: Any) -> Any:
        pipe = r.pipeline(transaction=self.transaction)
        self.queue(pipe)
        return await pipe.execute(raise_on_error=self.raise_on_error)


@dataclass(frozen=True)
class Single:
    """One command, ``call(client)`` (a client method: it returns the reply, or on an asyncio
    client an awaitable of it)."""

    call: Callable[[Any], Any]

    def send(self, r: Any) -> Any:
        return self.call(r)

    async def asend(self, r: Any) -> Any:
        return await self.call(r)


def run(r: redis.Redis, op: Op[T]) -> T:
    """Execute ``op`` on a blocking client: each round trip it yields is sent, and its reply
    (or error) handed back."""
    reply: Any = None
    error: Exception | None = None
    while True:
        try:
            step = op.send(reply) if error is None else op.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]  # the generator's return value
        try:
            reply, error = step.send(r), None
        except Exception as exc:  # handed to the operation, which raises it or not
            reply, error = None, exc


def run_all(r: redis.Redis, ops: Sequence[Op[Any]]) -> list[Any]:
    """Execute several operations side by side on a blocking client, as :func:`run` executes
    one: at each turn every operation still running yields its next round trip, and those that
    are :class:`Pipelined` without a transaction go out together, on one pipeline (each gets its
    own commands' replies, and its own first error if it raises on one); any other round trip is
    sent alone. Returns each operation's result, in order, or in its place the exception it
    raised (the others go on). A pass over fifty tiers reads their policies in one round trip
    instead of fifty."""
    results: list[Any] = [None] * len(ops)
    answers: dict[int, tuple[Any, Exception | None]] = dict.fromkeys(range(len(ops)), (None, None))
    while answers:
        steps: dict[int, RoundTrip] = {}
        for i, (reply, error) in answers.items():
            try:
                steps[i] = ops[i].send(reply) if error is None else ops[i].throw(error)
            except StopIteration as done:
                results[i] = done.value
            except Exception as exc:
                results[i] = exc
        answers = _send_together(r, steps)
    return results


def _send_together(r: redis.Redis, steps: Mapping[int, RoundTrip]) -> dict[int, tuple[Any, Exception | None]]:
    """Each step's reply or error: the pipelined ones (no transaction) on one pipeline."""
    answers: dict[int, tuple[Any, Exception | None]] = {}
    pipe, spans = r.pipeline(transaction=False), []
    for i, step in steps.items():
        if isinstance(step, Pipelined) and not step.transaction:
            start = len(pipe)
            step.queue(pipe)
            spans.append((i, step.raise_on_error, start, len(pipe)))
            continue
        try:
            answers[i] = step.send(r), None
        except Exception as exc:
            answers[i] = None, exc
    if not spans:
        return answers
    try:
        replies = pipe.execute(raise_on_error=False)
    except Exception as exc:  # (the connection: every operation on it is told)
        return answers | {i: (None, exc) for i, _, _, _ in spans}
    for i, raises, start, end in spans:
        mine = replies[start:end]
        error = next((x for x in mine if isinstance(x, Exception)), None) if raises else None
        answers[i] = (None, error) if error is not None else (mine, None)
    return answers


async def arun(r: aioredis.Redis, op: Op[T]) -> T:
    """:func:`run` on an asyncio client."""
    reply: Any = None
    error: Exception | None = None
    while True:
        try:
            step = op.send(reply) if error is None else op.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]  # the generator's return value
        try:
            reply, error = await step.asend(r), None
        except Exception as exc:  # handed to the operation, which raises it or not
            reply, error = None, exc


def is_async(r: Any) -> bool:
    """Whether ``r`` is an asyncio client (``fakeredis.FakeAsyncRedis`` is one)."""
    return isinstance(r, (aioredis.Redis, aioredis.RedisCluster))


class operation(Generic[P, T]):  # a decorator: named like a function
    """A store operation: called with a client first, it runs on that client (see the module
    docstring). ``steps`` is the generator itself, for another operation to run inline."""

    def __init__(self, steps: Callable[P, Op[T]]) -> None:
        self.steps = steps
        functools.update_wrapper(self, steps)

    @overload
    def __call__(self, r: redis.Redis, /, *args: P.args, **kwargs: P.kwargs) -> T: ...

    @overload
    def __call__(self, r: aioredis.Redis, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]: ...

    def __call__(self, r: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        op = self.steps(*args, **kwargs)
        return arun(r, op) if is_async(r) else run(r, op)
