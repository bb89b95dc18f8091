"""The Redis ACL roles of Fleet's processes, as data: each role's commands and key patterns.

One role per kind of process: ``fleet-client`` (submit turns and read replies, by the Python
client or the raw protocol), ``fleet-worker``, ``fleet-commander``, ``fleet-relay`` and
``fleet-operator`` (the CLI's admin commands). Every key pattern is built by a key builder of
:mod:`protocol.keys` (:func:`pattern`), so a renamed key renames its rule. ``fleet acl``
renders these roles as a Redis ACL file (:func:`acl_file`); the tests run every process as its
role, and a right a process lacks fails a test (``ACL LOG``).

A pattern is ``~`` (read and write), ``%R~`` (read only) or ``%W~`` (write only). Key
patterns are globs: ``{`` and ``}`` (the hash tags) match themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from protocol import keys

# The rights to run Fleet's functions library (stores.functions), in every role that calls it:
# FCALL and FCALL_RO only. No role may EVAL, EVALSHA, SCRIPT or FUNCTION LOAD/DELETE/FLUSH: the
# library is loaded by the admin (`fleet install`), so no Fleet password can load code.
SCRIPTING = "+fcall +fcall_ro"

# What every connection sends: PING (health), SELECT (the URL's database; a cluster node's
# refusal of SELECT 1 tells the connection it is one), and the read-only metadata redis-py's
# cluster client reads when it connects (CLUSTER SLOTS, COMMAND) and the commander's view of
# a failover (CLUSTER INFO). CLIENT SETINFO is redis-py's announcement of its name (Redis >= 7.2).
CONNECTION = ("ping", "select", "cluster|slots", "cluster|info", "command")

# Placeholders passed to the key builders; :func:`pattern` turns each into ``*``.
_USER, _TIER, _WORKER, _TOKEN, _GROUP = "ACLXUSER", "aclxtier", "aclxworker", "ACLXTOKEN", "aclxgroup"
_PLACEHOLDERS = (f"{_TIER}#1", f"{_TIER}.{_GROUP}", _USER, _TIER, _WORKER, _TOKEN, _GROUP)


def pattern(builder: Callable[..., str], *args: object) -> str:
    """The glob of the keys ``builder`` makes: ``builder`` called with placeholder ids, each
    placeholder turned into ``*`` (``pattern(keys.inbox, USER)`` is ``fleet:u:{*}:inbox``)."""
    key = builder(*args)
    for placeholder in _PLACEHOLDERS:
        key = key.replace(placeholder, "*")
    return key


USER, TIER, WORKER, TOKEN, GROUP = _USER, _TIER, _WORKER, _TOKEN, _GROUP


@dataclass(frozen=True)
class KeyRule:
    """A key pattern and the access to it: ``""`` read and write, ``"R"`` read, ``"W"`` write."""

    glob: str
    access: str = ""

    def render(self) -> str:
        return f"%{self.access}~{self.glob}" if self.access else f"~{self.glob}"


def rw(glob: str) -> KeyRule:
    """Read and write access to ``glob``."""
    return KeyRule(glob)


def ro(glob: str) -> KeyRule:
    """Read-only access to ``glob``."""
    return KeyRule(glob, "R")


@dataclass(frozen=True)
class Role:
    """One ACL user: who uses it, the commands it may send, the keys and channels it may touch."""

    name: str
    used_by: str
    commands: tuple[str, ...]
    keys: tuple[KeyRule, ...]
    channels: tuple[str, ...] = ()
    scripting: bool = True
    rq: bool = False  # uses RQ: RQ's rights on its own keys (a selector) on a node shared with RQ
    selectors: tuple[str, ...] = ()  # rights on some keys only: ``(~<pattern> +<command> ...)``

    def rules(self, shared_with_rq: bool = False) -> str:
        """The ACL rules after ``user <name> on <password>`` (no password); ``shared_with_rq``:
        with RQ's rights on ``rq:*`` if the role uses RQ (``RQ_SELECTOR``)."""
        channels = " ".join(f"&{c}" for c in self.channels)
        parts = ["resetkeys", "resetchannels", channels, "-@all",
                 *(f"+{c}" for c in (*CONNECTION, *self.commands)),
                 SCRIPTING if self.scripting else "",
                 *(k.render() for k in self.keys), *self.selectors,
                 RQ_SELECTOR if self.rq and shared_with_rq else ""]
        return " ".join(p for p in parts if p)

    def line(self, password: str, shared_with_rq: bool = False) -> str:
        """The ACL file line of this role: ``user <name> reset on #<sha256> <rules>``."""
        return f"user {self.name} reset on #{password_hash(password)} {self.rules(shared_with_rq)}"


def password_hash(password: str) -> str:
    """The SHA-256 hex of ``password``: what an ACL file holds instead of the password."""
    return hashlib.sha256(password.encode()).hexdigest()


# --- key groups ---------------------------------------------------------------------------
# ``fleet:{*}:ready`` also covers a tier's other ready shards (``fleet:{T#k}:ready``) and its
# groups' pools (``fleet:{T.G}:ready``). A script's keys (EVALSHA, FCALL) need read and write
# access whatever the script does with them: the pressure script reads ``starting``.
_SUBMIT_WRITES = (rw(pattern(keys.inbox, USER)), rw(pattern(keys.ready, TIER)),
                  rw(pattern(keys.active, TIER)), rw(pattern(keys.pressure, TIER)),
                  rw(pattern(keys.reply, USER, TOKEN)), rw(pattern(keys.starting, TIER)))
_SUBMIT_READS = (ro(pattern(keys.policy, TIER)), ro(pattern(keys.policy_good, TIER)),
                 ro(pattern(keys.groups_rejected, TIER)), ro(keys.TIERS),
                 ro(pattern(keys.pins, USER)), ro(pattern(keys.stream, USER, TOKEN)))
# A cancel (``stores.cancel``): the turn_cancel function's keys (the state hash it records the
# cancel in, the done-set it reads), the lane it reads for its holder, and that worker's cancels
# stream, which it writes only (never its control stream: a client cannot drain a worker).
_CANCEL_KEYS = (rw(pattern(keys.state, USER)), rw(pattern(keys.done, USER)), ro(pattern(keys.lane, USER)),
                KeyRule(pattern(keys.cancels, WORKER), "W"))
_ALL_FLEET = (rw(f"{keys.PREFIX}:*"), rw(keys.LEADER), rw(keys.EPOCH), rw(keys.WORKERS_VERSION))
# A worker serves any user (every user's keys) from its tiers' streams and sets, keeps its own
# keys, its registry entry and the registry's version, reports, and records its verdict on a
# policy (the last good copy and the status); it reads, never writes, the policy keys and the
# tiers' list, and touches neither the leader's lease, the ledger nor the commanders' hash.
_WORKER_KEYS = (rw(f"{keys.PREFIX}:u:{{*}}:*"), rw(f"{keys.PREFIX}:{{*}}:*"), rw(f"{keys.PREFIX}:w:{{*}}:*"),
                rw(keys.WORKERS), rw(keys.WORKERS_VERSION), rw(keys.REPORTS),
                rw(pattern(keys.policy_good, TIER) + "*"), rw(pattern(keys.policy_status, TIER) + "*"),
                ro(keys.POLICY_PREFIX + "*"), ro(keys.TIERS), ro(keys.RECOVERED))
# RQ's own commands (its scripts, queues, registries and pub/sub), on RQ's keys and channels
# only (a selector: they grant nothing on Fleet's keys), for the processes that use RQ
# (`--rq-url`) on a node shared with Fleet. RQ runs its Lua by EVALSHA and loads it itself; an
# RQ worker names its connection and reads its own address (CLIENT LIST: every client's address).
RQ_SELECTOR = ("(~rq:* &rq:* +@read +@write +@keyspace +@transaction +@pubsub -@dangerous -@scripting "
               "-scan +info +time +client|setname +client|info +client|list "
               "+evalsha +script|load +script|exists)")

_SUBMIT = ("xadd", "zadd", "blpop", "lpop", "xread", "get", "exists", "hgetall", "smembers", "xinfo|groups",
           "multi", "exec", "discard", "wait",
           "type", "zscore", "lindex", "hget", "xrange", "hsetnx")  # (the last: the cancel function's)
# A submit sets the tier's retention on the inbox it writes: PEXPIRE on inboxes only (a selector),
# never on the tier's streams and sets the client may write to.
INBOX_EXPIRY_SELECTOR = f"(~{pattern(keys.inbox, USER)} +pexpire)"

# What a worker and the commander send (a worker serves turns and reports; the commander also
# takes over a dead worker's streams, so it needs the same stream and lane commands). PERSIST: a
# commit after the tier's retention was turned off; INCRBY: redis-py's ``incr`` (the registry's
# version).
_SERVING = ("get", "set", "mget", "incr", "incrby", "del", "exists", "type", "pexpire", "pttl", "hget",
            "hset", "hmget", "hgetall", "hvals", "hdel", "hexists", "hincrby", "rpush", "lrange", "ltrim",
            "lrem", "sadd", "srem", "smembers", "sismember", "zadd", "zcount", "zscore", "zrevrange",
            "zrange", "zrem", "zremrangebyscore", "zremrangebyrank", "zscan", "xadd", "xread", "xreadgroup",
            "xack", "xautoclaim", "xclaim", "xpending", "xrange", "xrevrange", "xlen", "xtrim", "xdel",
            "xgroup|create", "xgroup|delconsumer", "xinfo|groups", "xinfo|consumers", "multi", "exec",
            "discard", "watch", "unwatch", "wait", "scan", "persist")

ROLES: tuple[Role, ...] = (
    Role("fleet-client", "the Python client, the raw protocol, fleet submit / chat / ask",
         _SUBMIT, (*_SUBMIT_WRITES, *_SUBMIT_READS, *_CANCEL_KEYS), selectors=(INBOX_EXPIRY_SELECTOR,)),
    Role("fleet-worker", "workers (fleet worker, started by the commander)",
         _SERVING,
         _WORKER_KEYS, rq=True),
    Role("fleet-commander", "the commander (fleet commander, fleet up)",
         _SERVING,
         _ALL_FLEET, rq=True),
    Role("fleet-relay", "the relay (fleet relay): deferred jobs into RQ",
         ("get", "hgetall", "hmget", "hset", "hdel", "smembers", "scan", "zscan", "zscore", "zrange",
          "xadd", "xread", "xreadgroup", "xack", "xautoclaim", "xclaim", "xpending", "xrange", "xdel", "xlen",
          "xgroup|create", "xinfo|groups", "multi", "exec", "discard", "wait"),
         (rw(keys.OUTBOX_READY), rw(keys.OUTBOX_DEAD), rw(keys.RELAYS),
          rw(pattern(keys.outbox, USER)), ro(keys.TIERS), ro(pattern(keys.active, TIER)),
          ro(keys.POLICY_PREFIX + "*")), scripting=False, rq=True),  # the relay calls no function
    Role("fleet-operator", "the CLI's admin commands: policies, rollouts, pins, dead letters, "
         "users, jobs, status, top, events",
         ("get", "set", "mget", "incr", "del", "exists", "pexpire", "pttl", "hget", "hset", "hmget",
          "hgetall", "hvals", "hdel", "hexists", "hincrby", "rpush", "lrange", "ltrim", "lrem", "sadd",
          "srem", "smembers", "sismember", "zadd", "zcount", "zscore", "zrevrange", "zrange", "zrem",
          "zremrangebyscore", "zremrangebyrank", "zscan", "xadd", "xread", "xack", "xautoclaim",
          "xclaim", "xpending", "xrange", "xrevrange", "xlen", "xtrim", "xdel",
          "xinfo|groups", "xinfo|consumers", "multi", "exec", "discard", "watch", "unwatch",
          "wait", "scan", "blpop"),
         _ALL_FLEET, rq=True),
)

ROLE_NAMES = tuple(role.name for role in ROLES)


def role(name: str) -> Role:
    """The role called ``name`` (``fleet-client``, …); a ``KeyError`` for any other name."""
    for candidate in ROLES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no Fleet role {name!r} (roles: {', '.join(ROLE_NAMES)})")


def acl_file(passwords: Mapping[str, str], default: str | None = None, shared_with_rq: bool = False) -> str:
    """A Redis ACL file: one ``user`` line per role, each with its password's hash. The
    ``default`` user is turned off unless ``default`` (its password) is given, then it keeps
    every right (the admin). ``shared_with_rq``: RQ keeps its queues on this node too (the
    roles that use RQ get RQ's rights on ``rq:*``, ``RQ_SELECTOR``)."""
    head = (f"user default on #{password_hash(default)} ~* &* +@all" if default is not None
            else "user default off resetkeys resetchannels -@all")
    return "\n".join([head, *(r.line(passwords[r.name], shared_with_rq) for r in ROLES)]) + "\n"
