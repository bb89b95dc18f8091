"""Every Redis key Fleet touches, built in one place.

Per-user keys carry the user id as a Redis Cluster hash tag (``fleet:u:{alice}:...``) so that
every per-user operation, including the Lua scripts, stays in one slot. Per-tier keys carry
the tier as their tag (``fleet:{chat}:ready``), per-worker keys the worker id
(``fleet:w:{w-1}:hb``). Callers pass ids that were validated at the
boundary (``protocol.ids``); the builders re-check them because a key is the last line.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

from protocol.groups import validate_group as _group
from protocol.groups import validate_pool
from protocol.ids import validate_tier, validate_token, validate_user_id

PREFIX = "fleet"
GROUP = "workers"  # the consumer group on every tier's ready stream

# --- global ---------------------------------------------------------------------------
REPORTS = f"{PREFIX}:reports"  # stream of OccupancyReport
EVENTS = f"{PREFIX}:events"  # stream: the scaling ledger
WORKERS = f"{PREFIX}:workers"  # hash: worker id -> msgpack WorkerInfo (the registry)
# The registry's version: a counter each writer of an entry bumps in the same round trip, so a
# reader that keeps the entries reads them again only when it changed. Its tag is the registry's
# name, so it shares the registry's slot (one node orders a writer's entry and its bump).
WORKERS_VERSION = f"{{{WORKERS}}}:version"
TIERS = f"{PREFIX}:tiers"  # set of tier names that have a policy
# The commander's leader lease and epoch counter carry ``fleet:events`` as their hash tag: a
# key without braces hashes whole, so ``{fleet:events}:leader`` shares the ledger's slot and
# the fenced ledger append (one Lua script over the three keys) is Cluster-safe.
LEADER = f"{{{EVENTS}}}:leader"  # string "<commander>|<epoch>" with a TTL
EPOCH = f"{{{EVENTS}}}:epoch"  # counter: every leadership gets a larger epoch
RECOVERED = f"{PREFIX}:recovered"  # the data epoch of the last failover recovery (stores.renotify)
COMMANDERS = f"{PREFIX}:commanders"  # hash: commander id -> msgpack CommanderInfo (leader and standbys)
# The relay's notifications: ``{user: U}`` per turn that deferred jobs, written right
# after its commit; one key (tag ``outbox``), read through consumer group ``RELAY_GROUP``.
OUTBOX_READY = f"{PREFIX}:{{outbox}}:ready"
OUTBOX_DEAD = f"{PREFIX}:{{outbox}}:dead"  # stream: outbox entries the relay could not enqueue
RELAY_GROUP = "relays"
# hash relay id -> its last heartbeat (wall time, written every loop): `fleet relay --check`
RELAYS = f"{PREFIX}:{{outbox}}:relays"
# RQ's own names (rq.worker_registration), read by the process runtime to see an RQ worker up
RQ_WORKERS = "rq:workers"  # set of "rq:worker:<name>"
RQ_WORKER_PREFIX = "rq:worker:"


def rq_worker(name: str) -> str:
    """RQ's hash of one worker (its member in ``RQ_WORKERS``)."""
    return f"{RQ_WORKER_PREFIX}{validate_token(name, 'worker id')}"


def rq_worker_name(key: str) -> str | None:
    """The worker name in an ``RQ_WORKERS`` member (None if it is not one a worker id could be)."""
    name = key[len(RQ_WORKER_PREFIX):] if key.startswith(RQ_WORKER_PREFIX) else ""
    try:
        return validate_token(name, "worker id")
    except ValueError:
        return None


# --- per user (hash tag = user id) -----------------------------------------------------
def _u(user: str, suffix: str) -> str:
    return f"{PREFIX}:u:{{{validate_user_id(user)}}}:{suffix}"


def inbox(user: str) -> str:
    """Stream of the user's submitted turns, in submission order."""
    return _u(user, "inbox")


def lane(user: str) -> str:
    """Lease string ``<worker>|<token>``: who may process this user's turns right now."""
    return _u(user, "lane")


def fence(user: str) -> str:
    """Counter handing out fencing tokens for the lane."""
    return _u(user, "fence")


def state(user: str) -> str:
    """Hash: ``cursor`` (last inbox id done), ``att:<entry>`` attempt counters, ``cancel:<entry>``
    the cancel of a turn not yet answered (``turn_cancel.lua``; its commit deletes it)."""
    return _u(user, "state")


def session(user: str) -> str:
    """List of msgpack SessionEntry, oldest first, bounded."""
    return _u(user, "session")


def profile(user: str) -> str:
    """Hash of profile fields (strings)."""
    return _u(user, "profile")


def memory(user: str) -> str:
    """Sorted set of msgpack MemoryItem scored by recency and importance (see stores.memory)."""
    return _u(user, "memory")


def done(user: str) -> str:
    """Sorted set of recent turn ids already answered (idempotency by turn id)."""
    return _u(user, "done")


def usage(user: str) -> str:
    """Hash of per-user consumption counters (turns, errors, chars in/out, handler_ms)."""
    return _u(user, "usage")


def outbox(user: str) -> str:
    """Stream of the user's deferred jobs, written by the turn commit, emptied by the relay."""
    return _u(user, "outbox")


def pins(user: str) -> str:
    """Hash tier -> group: the user's explicit group per tier (``fleet group pin``)."""
    return _u(user, "pins")


def reply(user: str, turn_id: str) -> str:
    """List the reply is pushed to; the submitter ``BLPOP``s it. Expires."""
    return _u(user, f"reply:{validate_token(turn_id, 'turn id')}")


def stream(user: str, turn_id: str) -> str:
    """Stream of a turn's streamed reply: ``k=chunk``/``k=restart`` entries tagged with the
    attempt, closed by ``k=end`` (docs/guide/protocol.md). Expires with the reply."""
    return _u(user, f"stream:{validate_token(turn_id, 'turn id')}")


def user_prefix(user: str) -> str:
    """What every key of ``user`` starts with: ``fleet:u:{U}:``."""
    return _u(user, "")


def user_key_names(user: str) -> tuple[str, ...]:
    """Every per-user key of ``user`` with a fixed name (the reply lists and reply streams are
    named by turn id: find them by :func:`user_prefix`)."""
    return (inbox(user), lane(user), fence(user), state(user), session(user), profile(user),
            memory(user), done(user), usage(user), outbox(user), pins(user))


@dataclass(frozen=True)
class UserKeys:
    """Every per-user key of one user, built once: the hot path asks for them every turn, and
    the id is validated when they are built, not again per key (:func:`user_keys`)."""

    user: str
    inbox: str
    lane: str
    fence: str
    state: str
    session: str
    profile: str
    memory: str
    done: str
    usage: str
    outbox: str

    def reply(self, turn_id: str) -> str:
        """:func:`reply` of this user."""
        return f"{PREFIX}:u:{{{self.user}}}:reply:{validate_token(turn_id, 'turn id')}"

    def stream(self, turn_id: str) -> str:
        """:func:`stream` of this user."""
        return f"{PREFIX}:u:{{{self.user}}}:stream:{validate_token(turn_id, 'turn id')}"


@lru_cache(maxsize=16_384)
def user_keys(user: str) -> UserKeys:
    """The keys of ``user`` (validated here, once per user while it stays in the cache)."""
    return UserKeys(validate_user_id(user), inbox(user), lane(user), fence(user), state(user),
                    session(user), profile(user), memory(user), done(user), usage(user), outbox(user))


# --- per tier (hash tag = tier) --------------------------------------------------------
# The data-plane keys of a tier (ready, active, pressure, starting, decide state) are per
# *pool*: the tier itself, or one group's pool ``<tier>.<group>`` (protocol.groups), tagged by it.
def _t(tier: str, suffix: str) -> str:
    return f"{PREFIX}:{{{validate_pool(tier)}}}:{suffix}"


def ready(tier: str, shard: int = 0) -> str:
    """Stream of notifications ``{user: U}``; read through consumer group ``GROUP``.

    A tier spreads over ``ready_shards`` streams (the policy's): shard 0 is ``fleet:{T}:ready``
    (so a tier of one shard is what it always was), shard ``k >= 1`` is ``fleet:{T#k}:ready``.
    The tag ``T#k`` hashes to its own slot (``#`` is no tier character, so ``T#k`` is never
    another tier's tag); of the tag schemes tried (``T:k``, ``T-k``, ``T#k``, ``T/k``), ``T#k``
    puts the 3 shards of ``chat`` in 3 different thirds of the slot space (``redis.crc``:
    14028, 5216, 9219), where ``T:k`` puts two of them in one (tests/unit/test_shards.py).
    """
    if shard == 0:
        return _t(tier, "ready")
    if not 0 < shard < MAX_READY_SHARDS:
        raise ValueError(f"ready shard {shard} is not in 0..{MAX_READY_SHARDS - 1}")
    return f"{PREFIX}:{{{validate_pool(tier)}#{shard}}}:ready"


MAX_READY_SHARDS = 64  # the policy's bound on ready_shards; workers look for shards up to it


def ready_shard(user: str, shards: int) -> int:
    """The shard of ``user``'s notifications on a tier of ``shards`` ready streams: CRC-32 of
    the user id mod ``shards`` (stable across processes and versions, never ``hash()``)."""
    if shards <= 1:
        return 0
    return zlib.crc32(validate_user_id(user).encode()) % shards


def shard_of_ready(tier: str, key: str | bytes) -> int:
    """The shard number of one of ``tier``'s ready stream keys (as an XREADGROUP reply names it)."""
    name = key.decode() if isinstance(key, bytes) else key
    if name == ready(tier):
        return 0
    head = f"{PREFIX}:{{{tier}#"
    if name.startswith(head) and name.endswith("}:ready"):
        return int(name[len(head):-len("}:ready")])
    raise ValueError(f"{name!r} is not a ready stream of tier {tier!r}")


def active(tier: str) -> str:
    """Sorted set user -> last submit time (seconds), for active-user counts."""
    return _t(tier, "active")


def dead(tier: str) -> str:
    """Dead-letter stream: turns that could not be served, with the reason."""
    return _t(tier, "dead")


def dead_bytes(tier: str) -> str:
    """Counter of the bytes the tier's dead letters hold (``dead_trim.lua`` keeps it)."""
    return _t(tier, "dead-bytes")


def pressure(tier: str) -> str:
    """Stream of pressure events: a submit found no free slot in the tier."""
    return _t(tier, "pressure")


POLICY_PREFIX = f"{PREFIX}:policy:"


def starting(tier: str) -> str:
    """Handler slots of workers the commander has started that do not serve yet (expires).

    The client subtracts it before it reports pressure: anti-windup at the request edge. It is
    rewritten every commander pass with a short TTL, so it heals if the commander dies.
    """
    return _t(tier, "starting")


def decide_state(tier: str) -> str:
    """The commander's decide() state of the tier (stabilization history), for a new leader."""
    return _t(tier, "decide-state")


def policy(tier: str) -> str:
    """JSON Policy edited by users (``fleet policy set`` or a raw ``SET``): ``fleet:policy:{chat}``."""
    return f"{POLICY_PREFIX}{{{validate_tier(tier)}}}"


def policy_good(tier: str, group: str = "") -> str:
    """The last policy that validated: what the fleet runs on when the key is invalid. A
    group's workers keep their own (``...:good:<group>``, same slot): a key valid for one
    group's virtualenv may name a handler another's lacks, which keeps its last good one."""
    return f"{policy(tier)}:good" + (f":{_group(group)}" if group else "")


def policy_status(tier: str, group: str = "") -> str:
    """Hash: ``ok`` 1/0, ``error`` (the rejection reason), ``source``, ``ts``; a group's workers
    record theirs apart (``...:status:<group>``), so two virtualenvs' verdicts do not overwrite
    each other."""
    return f"{policy(tier)}:status" + (f":{_group(group)}" if group else "")


def groups_rejected(tier: str) -> str:
    """Hash group -> reason: the tier's groups whose workers cannot start (the commander's
    verdict); assignment treats them as weight 0. In the policy key's slot: read with it."""
    return f"{policy(tier)}:rejected"


def pools(tier: str) -> str:
    """Set of the pools the commander has run the tier's users on (the tier itself, or its
    groups' ``<tier>.<group>``): a pool a policy edit removes stays in it until no turn queued
    on it is left to move to the user's pool now. In the policy key's slot."""
    return f"{policy(tier)}:pools"


# --- per worker (hash tag = worker id) ---------------------------------------------------
# Tagged by worker, so the keys of one worker share a slot: deregistering deletes its
# heartbeat and control stream together (``DEL``) on a Cluster too.
def _w(worker: str, suffix: str) -> str:
    return f"{PREFIX}:w:{{{validate_token(worker, 'worker id')}}}:{suffix}"


def heartbeat(worker: str) -> str:
    """String with a TTL; missing means the worker is dead: ``fleet:w:{<id>}:hb``."""
    return _w(worker, "hb")


def control(worker: str) -> str:
    """Stream of Control messages (drain) for one worker: ``fleet:w:{<id>}:control``."""
    return _w(worker, "control")


def cancels(worker: str) -> str:
    """Stream of cancel commands for one worker, written by clients (``Fleet.cancel``) to the
    holder of a user's lane: ``fleet:w:{<id>}:cancels``. Apart from ``control``: a client may
    write here, and a worker obeys nothing here but a cancel."""
    return _w(worker, "cancels")
