"""One chat turn as a plain job, for the peer job systems (RQ, Celery, Dramatiq, SAQ, arq):
written once, here (``run_turn`` for the thread- and process-based ones, ``run_turn_async`` with
the same commands for the asyncio ones).

It does what a Fleet worker does for a turn with the ``noop`` handler, with the same keys and
the same encodings (``protocol.keys``, ``protocol.codec``):

1. pull the user's context pack (session tail, profile, top-K memories) in one pipelined
   round trip;
2. run the model call: a no-op, or ``model_ms`` of sleep (the scale-up bursts need turns
   that occupy a process);
3. write back in one ``MULTI``/``EXEC``: session entry, one memory, one profile field, the
   usage counters and the reply, which the submitter ``BLPOP``s on ``keys.reply``.

What it does *not* do is what Fleet adds around the same reads and writes: no per-user lane
(two turns of one user may run at once, in any order), no fencing token, no duplicate check
by turn id, no attempt counter, no cursor. A peer that runs a job twice writes it twice.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import redis
import redis.asyncio as aioredis

from protocol import keys
from protocol.codec import CodecError, decode, encode
from protocol.models import Reply, SessionEntry
from stores.memory import new_member, parse_members
from stores.turns import StoreConfig

CFG = StoreConfig()  # Fleet's bounds: session tail, top-K, store sizes, reply TTL


def pull(r: redis.Redis, user: str) -> tuple[list[SessionEntry], dict[str, str], list]:
    """Session tail, profile and top-K memories in one round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.lrange(keys.session(user), -CFG.context_turns, -1)
    pipe.hgetall(keys.profile(user))
    pipe.zrevrange(keys.memory(user), 0, CFG.memory_k - 1)
    session_raw, profile_raw, memories_raw = pipe.execute()
    profile = {k.decode(): v.decode() for k, v in profile_raw.items()}
    return _sessions(session_raw), profile, parse_members(memories_raw)


def _sessions(raw: list[bytes]) -> list[SessionEntry]:  # (decoded as Fleet's worker does)
    out = []
    for item in raw:
        try:
            out.append(decode(SessionEntry, item))
        except CodecError:  # as Fleet: a corrupt entry must not cost the user the turn
            continue
    return out


def run_turn(r: redis.Redis, user: str, turn_id: str, text: str, model_ms: float = 0.0) -> Reply:
    """Serve one turn and push its reply; returns the reply (its ``context.started`` is the start)."""
    started = time.time()
    session, profile, memories = pull(r, user)
    if model_ms > 0:
        time.sleep(model_ms / 1000)
    reply = _reply(user, turn_id, started, session, profile, memories)
    pipe = r.pipeline(transaction=True)  # MULTI/EXEC: the write-back is atomic, as Fleet's Lua commit
    _queue_write_back(pipe, user, turn_id, text, reply)
    pipe.execute()
    return reply


async def run_turn_async(r: aioredis.Redis, user: str, turn_id: str, text: str,
                         model_ms: float = 0.0) -> Reply:
    """``run_turn`` on an asyncio client: the same commands, in the same round trips."""
    started = time.time()
    pipe = r.pipeline(transaction=False)
    pipe.lrange(keys.session(user), -CFG.context_turns, -1)
    pipe.hgetall(keys.profile(user))
    pipe.zrevrange(keys.memory(user), 0, CFG.memory_k - 1)
    session_raw, profile_raw, memories_raw = await pipe.execute()
    profile = {k.decode(): v.decode() for k, v in profile_raw.items()}
    if model_ms > 0:
        await asyncio.sleep(model_ms / 1000)
    reply = _reply(user, turn_id, started, _sessions(session_raw), profile, parse_members(memories_raw))
    apipe = r.pipeline(transaction=True)
    _queue_write_back(apipe, user, turn_id, text, reply)
    await apipe.execute()
    return reply


def _reply(user: str, turn_id: str, started: float, session: list[SessionEntry], profile: dict[str, str],
           memories: list) -> Reply:
    context = {"session_turns": len(session), "memories": [m.text for m in memories], "profile": profile,
               "started": started}
    return Reply(turn_id=turn_id, user=user, ok=True, text="", worker=f"pid{os.getpid()}",  # no-op model
                 ts=time.time(), context=context)


def _queue_write_back(pipe: Any, user: str, turn_id: str, text: str, reply: Reply) -> None:
    """Session entry, one memory, one profile field, the usage counters and the reply."""
    now, result_text = reply.ts, reply.text
    entry = SessionEntry(turn_id=turn_id, entry=turn_id, text=text, reply=result_text, ts=now)
    member, score = new_member(text[:200], 0.5, now)
    pipe.rpush(keys.session(user), encode(entry))
    pipe.ltrim(keys.session(user), -CFG.session_max, -1)
    pipe.zadd(keys.memory(user), {member: score})
    pipe.zremrangebyrank(keys.memory(user), 0, -(CFG.memory_max + 1))
    pipe.hset(keys.profile(user), "last_text", text[:200])
    pipe.hincrby(keys.usage(user), "turns", 1)
    pipe.hincrby(keys.usage(user), "chars_in", len(text))
    pipe.hincrby(keys.usage(user), "chars_out", len(result_text))
    pipe.rpush(keys.reply(user, turn_id), encode(reply))
    pipe.pexpire(keys.reply(user, turn_id), CFG.reply_ttl_ms)
