"""A group whose workers cannot start here (the runtime's ``check_group``: its interpreter is
missing or cannot load its handler) is rejected: weight 0 for assignment, so its users are
served by the other groups, ledgered, shown as its pool's error; accepted again once it can.
While the runtime is still checking (``CHECK_PENDING``), the verdict recorded last holds."""

from __future__ import annotations

from collections.abc import Callable

import redis
from redis.exceptions import ResponseError

from commander.ledger_writer import LedgerWriter
from commander.runtime import Runtime
from commander.runtime.interface import CHECK_PENDING
from protocol import keys
from protocol.groups import split_pool
from stores.bad_state import DEFAULT, BadState, reject_wrong_type
from stores.group_assignment import accept_group, reject_group, rejected_groups


class GroupChecks:
    """The verdict on each group's pool, as last recorded in Redis."""

    def __init__(self, r: redis.Redis, runtime: Runtime, ledger: LedgerWriter,
                 bad: BadState = DEFAULT) -> None:
        self._r, self._runtime, self._ledger, self._bad = r, runtime, ledger, bad
        self._verdicts: dict[str, str | None] = {}  # pool -> why it is rejected (None: accepted)

    def rejected(self, pool: str) -> str | None:
        """Why ``pool``'s group cannot start workers, or None (a tier's own pool: None). A
        changed verdict is recorded for assignment and in the ledger."""
        tier, group = split_pool(pool)
        if not group:
            return None
        why = self._runtime.check_group(pool)
        if pool not in self._verdicts:  # a new leader: what the last one recorded
            self._verdicts[pool] = rejected_groups(self._r, tier).get(group)
        was = self._verdicts[pool]
        if why == CHECK_PENDING:  # no verdict yet: the recorded one holds
            return was
        if why is not None and why != was:
            self._record(tier, lambda: reject_group(self._r, tier, group, why))
            self._ledger.record(pool, "group-rejected", reason=f"group {group} of tier {tier} "
                                f"rejected: {why}; its users are served by the other groups")
        elif why is None and was is not None:
            self._record(tier, lambda: accept_group(self._r, tier, group))
            self._ledger.record(pool, "group-accepted", reason=f"group {group} of tier {tier} "
                                "can start workers again: its users come back to it")
        self._verdicts[pool] = why
        return why

    def _record(self, tier: str, write: Callable[[], object]) -> None:
        """Record a verdict for assignment; a rejected-groups key of another type is told to
        ``bad`` instead (the commander still holds the pool back; clients do not see it)."""
        try:
            write()
        except ResponseError as exc:
            self._bad.note("pool", keys.groups_rejected(tier), "", reject_wrong_type(exc))
