"""``fleet relay``: move committed deferrals from users' outboxes into RQ, each exactly once.

Its own process (not a stage of the commander's pass): the commander's pass is paced by its
interval and does its judging on a blocking loop, while the relay's latency is a deferral's
(it blocks on the relay stream and wakes per notification); relays scale apart from the leader
(any number may run: the consumer group shares the notifications, and RQ's unique job ids keep
two relays from enqueueing one job twice); and a relay can be killed and restarted alone.

Exactly once in RQ, for each crash point of one user's pass (``relay_user``):
  - before a job is enqueued: the entry is still in the outbox and the notification still
    pending, so a relay claims it once idle and enqueues it;
  - after the enqueue, before the entry is deleted: the next pass finds the entry, and RQ
    refuses its job id (``unique=True``: the check and the save are one script), so the entry
    is deleted with no second job;
  - after the delete, before the notification's ack: the next pass finds the outbox empty and
    acks it.
A duplicate check needs RQ to still hold the job's hash: ``result_ttl_s`` (default one day) is
how long a finished job is kept, so a relay that dies after an enqueue and stays down longer
than that could enqueue the job again; failed jobs are kept a year (RQ's ``failure_ttl``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import redis
from pydantic import BaseModel, ConfigDict, Field

from protocol.codec import CodecError, decode
from protocol.deferral import RESULT_TTL_S, Deferral
from protocol.policy import Policy, RqPolicy
from stores import outbox
from stores.connection import connect_rq, connect_sync
from stores.outbox import Hint
from stores.policies import list_tiers, read_policy
from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT, Backoff
from stores.roles import process_url
from worker.rq.relay_health import DEFAULT_MAX_AGE_S, default_relay_id, gone, judge

log = logging.getLogger("fleet.relay")
_BACKOFF = Backoff(base=0.05, cap=2.0)
POLICY_REFRESH_S = 5.0  # how often the rq tiers' job settings (retries, timeout) are read again


class TierJobs(NamedTuple):
    """What an rq tier's policy sets for the jobs of its queues (None: the job's own)."""

    retry_max: int | None
    retry_interval_s: tuple[int, ...] | None
    job_timeout_s: int | None


def tier_overrides(policies: Mapping[str, Policy]) -> dict[str, TierJobs]:
    """Queue -> what the rq tier that consumes it sets for its jobs (``jobs.retry_max`` and its
    intervals, ``jobs.timeout_s``), for tiers that set any; a queue of two such tiers takes the
    first tier's (by name)."""
    out: dict[str, TierJobs] = {}
    for tier in sorted(policies):
        p = policies[tier]
        if isinstance(p, RqPolicy) and (p.jobs.retry_max is not None or p.jobs.timeout_s is not None):
            for q in p.rq_queues(tier):
                out.setdefault(q, TierJobs(p.jobs.retry_max, p.jobs.retry_interval_s, p.jobs.timeout_s))
    return out


def with_tier(d: Deferral, overrides: Mapping[str, TierJobs]) -> Deferral:
    """The deferral with its queue's tier's settings in place of its job's registration's."""
    found = overrides.get(d.queue)
    if found is None:
        return d
    update: dict[str, object] = {}
    if found.retry_max is not None:
        update["retry_max"] = found.retry_max
        if found.retry_interval_s is not None:
            update["retry_interval_s"] = list(found.retry_interval_s)
    if found.job_timeout_s is not None:
        update["job_timeout_s"] = found.job_timeout_s
    return d.model_copy(update=update)


class RelaySettings(BaseModel):
    """One relay process's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str | None = None
    rq_url: str | None = None  # RQ's Redis (one node); None: Fleet's own (which must be one node)
    relay_id: str = Field(default_factory=default_relay_id)  # relay-<host>-<pid> (relay_health)
    batch: int = Field(default=100, ge=1, le=10_000)
    block_ms: int = Field(default=1_000, ge=1, le=60_000)
    claim_idle_ms: int = Field(default=5_000, ge=0)  # a notification pending that long is claimed
    sweep_interval_s: float = Field(default=10.0, gt=0)  # active sets walked for un-notified outboxes
    result_ttl_s: int = Field(default=RESULT_TTL_S, ge=60)


@dataclass
class RelayStats:
    enqueued: int = 0
    duplicates: int = 0  # entries whose job RQ held already (a retried pass)
    dead: int = 0
    passes: int = 0
    by_queue: dict[str, int] = field(default_factory=dict)


class Relay:
    """Moves outbox entries into RQ (see the module's doc for why each step is where it is)."""

    def __init__(self, settings: RelaySettings, r: redis.Redis | None = None,
                 rq: redis.Redis | None = None) -> None:
        self.s = settings
        self.r = r if r is not None else connect_sync(settings.redis_url)
        if rq is not None:
            self.rq = rq
        elif settings.rq_url:
            self.rq = connect_rq(settings.rq_url)
        else:
            self.rq = self.r
        from stores import rqjobs  # the rq extra: imported by a relay only, not by `fleet --help`

        self._rqjobs = rqjobs
        self.stats = RelayStats()
        self.redis_errors = RedisErrors(log)  # each kind logged once; the counts logged at exit
        self.stop = threading.Event()
        self._claim_cursor = "0-0"
        # None: never yet, so a relay's first pass claims and sweeps at once (one started after
        # a crash picks up what was left without waiting an interval)
        self._last_claim: float | None = None
        self._last_sweep: float | None = None
        self._last_policies: float | None = None
        self.tier_jobs: dict[str, TierJobs] = {}  # queue -> its rq tier's job settings (policy)

    def run(self) -> None:
        """Relay until ``stop`` is set. Any Redis error (BUSY, NOPERM, READONLY, LOADING, ...)
        is logged once per kind, backed off and retried, never fatal: an entry not relayed
        stays in its outbox, its notification pending."""
        failures, joined = 0, False
        while not self.stop.is_set():
            try:
                if not joined:
                    outbox.join_relay_group(self.r)
                    joined = True
                self.step()
                outbox.beat_relay(self.r, self.s.relay_id, time.time())  # (`fleet relay --check`)
                failures = 0
                self.redis_errors.answered("relay")
            except TRANSIENT as exc:
                if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
                    log.warning("the relays' group is gone (Redis restarted empty?): creating it again")
                    joined = False
                    continue
                failures += 1
                self.redis_errors.failed("relay", exc)
                self.stop.wait(_BACKOFF.compute(failures))

    def step(self) -> None:
        """One pass: claim idle notifications, read new ones, relay their users, ack them; and
        now and then sweep the active sets for outboxes whose notification was never written."""
        now = time.monotonic()
        if self._last_policies is None or now - self._last_policies >= POLICY_REFRESH_S:
            self._last_policies = now
            self.read_tier_jobs()
        hints: list[Hint] = []
        if self._last_claim is None or now - self._last_claim >= self.s.claim_idle_ms / 1000:
            self._last_claim = now
            self._claim_cursor, hints = outbox.claim_idle_hints(
                self.r, self.s.relay_id, self.s.claim_idle_ms, self._claim_cursor, self.s.batch)
        if not hints:
            hints = outbox.read_hints(self.r, self.s.relay_id, self.s.batch, self.s.block_ms)
        self.handle(hints)
        if self._last_sweep is None or now - self._last_sweep >= self.s.sweep_interval_s:
            self._last_sweep = now
            self.sweep()
            outbox.forget_relays(self.r, gone(outbox.relay_beats(self.r), time.time()))
        self.stats.passes += 1

    def read_tier_jobs(self) -> None:
        """The rq tiers' job settings, from their policies (each tier's last good one)."""
        self.tier_jobs = tier_overrides({t: read_policy(self.r, t).policy for t in list_tiers(self.r)})

    def handle(self, hints: list[Hint]) -> None:
        """Relay each user named once, then ack the notifications of the users relayed whole (a
        user whose pass failed keeps its notifications pending: claimed again once idle)."""
        failed: set[str] = set()
        for user in dict.fromkeys(h.user for h in hints if h.user is not None):
            try:
                self.relay_user(user)
                self.redis_errors.answered("outbox")
            except TRANSIENT as exc:
                failed.add(user)
                self.redis_errors.failed("outbox", exc)
        done = [h.id for h in hints if h.user not in failed]  # a hint naming no user: nothing to do
        outbox.ack_hints(self.r, done)

    def relay_user(self, user: str) -> int:
        """Enqueue every entry of ``user``'s outbox, deleting each batch once RQ holds it; the
        number of entries handled."""
        handled = 0
        while True:
            entries = outbox.read_outbox(self.r, user, self.s.batch)
            if not entries:
                return handled
            for entry in entries:
                self.relay_entry(user, entry)
            outbox.delete_entries(self.r, user, [e.id for e in entries])
            handled += len(entries)

    def relay_entry(self, user: str, entry: outbox.Entry) -> None:
        """Enqueue one outbox entry of ``user`` in RQ (a duplicate of a job RQ holds is counted,
        not enqueued); one that is no deferral of this user is dead-lettered."""
        try:
            d = decode(Deferral, entry.payload)
            if d.user != user or d.job_id != entry.job:
                raise CodecError(f"entry names job {entry.job!r} of {d.user!r}, not {d.job_id!r} of {user!r}")
        except CodecError as exc:
            log.error("outbox entry %s of %s is not a deferral: %s", entry.id, user, exc)
            outbox.dead_letter(self.r, user, entry, str(exc), time.time())
            self.stats.dead += 1
            return
        if self._rqjobs.enqueue(self.rq, with_tier(d, self.tier_jobs), self.s.result_ttl_s):
            self.stats.enqueued += 1
            self.stats.by_queue[d.queue] = self.stats.by_queue.get(d.queue, 0) + 1
        else:
            self.stats.duplicates += 1

    def sweep(self) -> int:
        """Relay the users of every tier's active set whose outbox holds entries (a worker died
        between its commit and the notification); the number of users relayed."""
        users = list(outbox.users_with_entries(self.r, outbox.registered_tiers(self.r)))
        for user in users:
            try:
                self.relay_user(user)
                self.redis_errors.answered("outbox")
            except TRANSIENT as exc:
                self.redis_errors.failed("outbox", exc)
        return len(users)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rq-url", help="RQ's Redis (one node; default: $FLEET_RQ_URL, else Fleet's own)")
    p.add_argument("--id", dest="relay_id",
                   help="this relay's consumer name and heartbeat id (default: relay-<host>-<pid>)")
    p.add_argument("--batch", type=int, default=100, help="notifications and outbox entries per read")
    p.add_argument("--sweep-interval", type=float, default=10.0,
                   help="seconds between walks of the active sets for outboxes without a notification")
    p.add_argument("--claim-idle-ms", type=int, default=5_000,
                   help="claim another relay's notification pending this long (a dead relay's)")
    p.add_argument("--result-ttl", type=int, default=RESULT_TTL_S,
                   help="seconds RQ keeps a finished job (the duplicate check's memory)")
    p.add_argument("--check", action="store_true",
                   help="relay nothing: exit 0 if the relay --id (default: this host's newest) beat "
                        "within --max-age seconds, else 1 with the reason (a health check)")
    p.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S,
                   help=f"--check: the staleness bound in seconds (default {DEFAULT_MAX_AGE_S:g})")


def check(args: argparse.Namespace) -> int:
    """``fleet relay --check``: 0 and one line on stdout if the relay's heartbeat is fresh, else
    1 and the reason on stderr (no heartbeat, a stale one, Redis unreachable)."""
    try:
        r = connect_sync(process_url(getattr(args, "redis_url", None), "fleet-relay"),
                         retries=1, socket_timeout=5)
        beats = outbox.relay_beats(r)
    except (redis.RedisError, OSError, ValueError) as exc:
        print(f"fleet relay --check: cannot read the relays' heartbeats: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    ok, line = judge(beats, time.time(), args.max_age, args.relay_id)
    print(f"fleet relay --check: {line}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """``fleet relay``: relay until SIGTERM/SIGINT (``--check``: judge a relay's heartbeat)."""
    if getattr(args, "check", False):
        return check(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = RelaySettings(redis_url=getattr(args, "redis_url", None) or os.environ.get("REDIS_URL"),
                             rq_url=args.rq_url or os.environ.get("FLEET_RQ_URL"), batch=args.batch,
                             sweep_interval_s=args.sweep_interval,
                             claim_idle_ms=args.claim_idle_ms, result_ttl_s=args.result_ttl,
                             **({"relay_id": args.relay_id} if args.relay_id else {}))
    settings = settings.model_copy(update={"redis_url": process_url(settings.redis_url, "fleet-relay")})
    relay = Relay(settings)

    def _stop(signum: int, _frame: object) -> None:
        relay.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("relay %s started", settings.relay_id)
    relay.run()
    log.info("relay %s stopped: %s; Redis errors by kind: %s", settings.relay_id, relay.stats,
             relay.redis_errors.counts)
    return 0
