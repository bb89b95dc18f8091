"""What a deferred job reads and writes of its user, on a blocking client (an RQ worker's).

The reads are a turn's context pack (``UserStore.pull`` without the turn's own bookkeeping); a
job's writes go to the user's slot in one transaction each.
"""

from __future__ import annotations

import time

import redis

from protocol import keys
from protocol.codec import as_str
from stores.memory import new_member, parse_members
from stores.turns import ContextPack, StoreConfig

MEMORY_MAX = StoreConfig().memory_max  # a job's memory write keeps a turn's bound


def pull(r: redis.Redis, user: str, session_turns: int = 20, memories: int = 5) -> ContextPack:
    """The user's session tail, profile and top memories, in one round trip (0 reads none)."""
    k = keys.user_keys(user)
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(k.profile)
    if session_turns > 0:  # LRANGE -0 -1 would be the whole list
        pipe.lrange(k.session, -session_turns, -1)
    if memories > 0:
        pipe.zrevrange(k.memory, 0, memories - 1)
    replies = pipe.execute()
    profile_raw = replies.pop(0)
    session_raw = replies.pop(0) if session_turns > 0 else []
    memories_raw = replies.pop(0) if memories > 0 else []
    return ContextPack(session_raw=session_raw,
                       profile={as_str(f): as_str(v) for f, v in profile_raw.items()},
                       memories=parse_members(memories_raw))


def incr_usage(r: redis.Redis, user: str, counter: str, by: int = 1) -> int:
    """Add ``by`` to the user's usage ``counter``; the new value."""
    return int(r.hincrby(keys.usage(user), counter, by))


def add_memory(r: redis.Redis, user: str, text: str, importance: float, count: str | None = None) -> None:
    """Add one memory (bounded like a turn's), and with ``count`` add 1 to that usage counter,
    in one transaction on the user's slot."""
    k = keys.user_keys(user)
    member, score = new_member(text, importance, time.time())
    pipe = r.pipeline(transaction=True)
    pipe.zadd(k.memory, {member: score})
    pipe.zremrangebyrank(k.memory, 0, -(MEMORY_MAX + 1))
    if count:
        pipe.hincrby(k.usage, count, 1)
    pipe.execute()
