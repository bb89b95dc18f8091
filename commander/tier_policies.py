"""The policy each tier (or group pool) runs this pass, and its verdict in the ledger.

A tier runs its policy key, unless the key is invalid or names a handler that none of the
tier's live workers has: they keep their last good policy then, and the key is *rejected*
(ledgered when the verdict changes, shown by the monitor while it lasts, a metric). A group's
pool runs its group's policy; a pool no group names is *removed* (``commander.rollouts``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from commander.ledger_writer import LedgerWriter
from commander.metrics import Metrics
from commander.rollouts.pools import pool_policy
from protocol import keys
from protocol.groups import split_pool
from protocol.models import WorkerInfo
from protocol.policy import Policy
from stores.bad_state import DEFAULT, BadState
from stores.policies import PolicyRead, policy_key_tiers, read_policy, registered_tiers
from stores.roundtrips import run_all

log = logging.getLogger("fleet.commander")


SCAN_EVERY_S = 30.0  # look for policy keys not in ``fleet:tiers`` (a raw SET) this often


class TierNames:
    """The tiers known to the fleet, as a commander's pass needs them: ``fleet:tiers`` every pass
    (one round trip), and the tiers of the policy keys a ``SCAN`` of the whole keyspace finds
    (a round trip per 500 keys: 2,000 with a million users' keys) only every ``SCAN_EVERY_S``
    and on the first pass. A tier defined by a raw ``SET`` of its policy key alone is judged
    within that time; ``fleet policy set`` adds the tier to ``fleet:tiers``, judged at once."""

    def __init__(self, r: redis.Redis, monotonic: Callable[[], float], bad: BadState = DEFAULT) -> None:
        self._r, self._monotonic, self._bad = r, monotonic, bad
        self._scanned: set[str] = set()
        self._scanned_at: float | None = None

    def __call__(self) -> set[str]:
        """The tiers known now."""
        now = self._monotonic()
        if self._scanned_at is None or now - self._scanned_at >= SCAN_EVERY_S:
            self._scanned, self._scanned_at = policy_key_tiers(self._r), now
        return registered_tiers(self._r, self._bad) | self._scanned


@dataclass(frozen=True)
class TierPolicy:
    """A tier's or pool's policy for this pass."""

    read: PolicyRead  # the policy in force, where it came from, and the key's error if any
    rejected: str | None = None  # why the policy key is rejected now (None: it is in force)
    removed: bool = False  # a pool no group of its tier's policy names: its workers are drained


class TierPolicies:
    """Reads each tier's policy and remembers the verdict last ledgered and the policy in force."""

    def __init__(self, r: redis.Redis, ledger: LedgerWriter, metrics: Metrics | None,
                 bad: BadState = DEFAULT) -> None:
        self._r, self._ledger, self._metrics, self._bad = r, ledger, metrics, bad
        self._verdicts: dict[str, tuple[str, str | None]] = {}  # tier -> (source, error) ledgered
        self._in_force: dict[str, Policy] = {}
        self._handlers_of: dict[str, tuple[Mapping[str, tuple[WorkerInfo, bool]], list[str]]] = {}

    def in_force(self, tier: str) -> Policy | None:
        """The policy the tier ran at its last pass (None before its first)."""
        return self._in_force.get(tier)

    def read_all(self, tiers: Sequence[str], by_tier: Mapping[str, Mapping[str, tuple[WorkerInfo, bool]]],
                 ) -> dict[str, TierPolicy | Exception]:
        """The policy each of ``tiers``' workers run (``by_tier``: each one's registry entries),
        checked against the handlers its live workers have (the structure only while none is
        live); every key read side by side, in one round trip. A tier whose read raised has its
        exception in place of its policy."""
        handlers = {tier: self._handlers(tier, by_tier.get(tier, {})) for tier in tiers}
        ops = []
        for tier in tiers:
            base, group = split_pool(tier)
            ops.append(read_policy.steps(base, handlers[tier] or None, group=group or None))
        out: dict[str, TierPolicy | Exception] = {}
        for tier, read in zip(tiers, run_all(self._r, ops), strict=True):
            try:
                out[tier] = read if isinstance(read, Exception) else \
                    self._judged(tier, read, handlers[tier], by_tier.get(tier, {}))
            except Exception as exc:  # (a ledger append fenced off: the caller's to raise)
                out[tier] = exc
        return out

    def _handlers(self, tier: str, registry: Mapping[str, tuple[WorkerInfo, bool]]) -> list[str]:
        """:func:`handlers_of` ``tier``'s entries, kept while they are the same object (a
        commander's registry unchanged since the last pass)."""
        kept = self._handlers_of.get(tier)
        if kept is None or kept[0] is not registry:
            kept = self._handlers_of[tier] = registry, handlers_of(tier, registry)
        return kept[1]

    def _judged(self, tier: str, read: PolicyRead, known: list[str],
                registry: Mapping[str, tuple[WorkerInfo, bool]]) -> TierPolicy:
        """The verdict on ``tier``'s key as read: ledgered when it changed, and the policy in force."""
        base, group = split_pool(tier)
        why = read.error
        if read.missing_handler is not None:
            name = read.missing_handler
            load_error = next((info.handler_errors[name] for info, alive in registry.values()
                               if alive and info.tier == tier and name in info.handler_errors), None)
            why = (f"no live worker of tier {tier} has handler {read.missing_handler!r} "
                   + (f"(it cannot be loaded there: {load_error})" if load_error else
                      f"(they have: {', '.join(known)}; install it where they run)"))
        self._note_verdict(tier, read, why)
        if read.error is not None and read.missing_handler is None:  # garbage, another type, invalid
            self._bad.note("policy", keys.policy(base), group, read.error)
        read, removed = pool_policy(tier, read)
        self._in_force[tier] = read.policy
        if self._metrics is not None:
            self._metrics.policy_rejected(tier, read.error is not None)
        return TierPolicy(read, why, removed)

    def _note_verdict(self, tier: str, read: PolicyRead, why: str | None) -> None:
        """Ledger a changed verdict on the key (the first look only if it is rejected)."""
        verdict = (read.source, read.error)
        last = self._verdicts.get(tier)
        if verdict != last and (read.error or last is not None):
            action = "policy-rejected" if read.error else "policy-applied"
            reason = f"policy key rejected: {why}; running the {read.source} policy" \
                if read.error else f"policy from {read.source} in force"
            self._ledger.record(tier, action, reason=reason)
            (log.warning if read.error else log.info)("tier %s: %s", tier, reason)
        self._verdicts[tier] = verdict


def handlers_of(tier: str, registry: Mapping[str, tuple[WorkerInfo, bool]]) -> list[str]:
    """The handlers ``tier``'s live workers registered, sorted."""
    names: set[str] = set()
    for info, alive in registry.values():
        if alive and info.tier == tier:
            names.update(info.handlers)
    return sorted(names)
