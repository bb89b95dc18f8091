"""How long one judge pass takes: ``decide`` over every tier of a synthetic fleet.

``python scripts/bench_decide.py`` prints median and p95 milliseconds for one full pass
(all tiers), with realistic mixes of idle, busy, stale, starting and draining workers.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from commander.decide import TierState, decide
from commander.snapshot import TierSnapshot, WorkerView
from protocol.policy import turns_policy


def _worker(rng: random.Random, tier: int, i: int) -> WorkerView:
    state = rng.choices(["ready", "starting", "draining"], weights=[90, 5, 5])[0]
    busy = rng.choice([0, 0, 1, 2, 4, 8])
    return WorkerView(
        id=f"t{tier}-w{i}",
        state=state,  # type: ignore[arg-type]
        occupancy=min(1.2, busy / 8 + rng.random() * 0.1),
        busy=busy,
        total=8,
        lanes=busy,
        fresh=state == "ready" and rng.random() > 0.05,
        started=float(i),
    )


def synthetic_fleet(workers: int, tiers: int, seed: int = 7) -> list[TierSnapshot]:
    """``workers`` workers spread over ``tiers`` tiers, with random but fixed signals."""
    rng = random.Random(seed)
    per_tier = max(1, workers // tiers)
    return [
        TierSnapshot(
            tier=f"tier{t}",
            workers=tuple(_worker(rng, t, i) for i in range(per_tier)),
            active_users=rng.randint(0, 5000),
            backlog=rng.randint(0, 400),
            rps=rng.random() * 200,
            pressure_events=rng.choice([0, 0, 0, 1, 5]),
        )
        for t in range(tiers)
    ]


def bench(workers: int = 1000, tiers: int = 20, repeats: int = 20) -> dict[str, float]:
    """Time ``repeats`` full passes (every tier once); median and p95 in milliseconds."""
    snapshots = synthetic_fleet(workers, tiers)
    policy = turns_policy(max_workers=max(8, 2 * workers // tiers), target_rps_per_worker=10.0,
                          scale_down_stabilization_s=300.0).scale_rules()
    states = {s.tier: TierState() for s in snapshots}
    samples: list[float] = []
    now = 1_700_000_000.0
    for _ in range(repeats + 2):  # two warm-up passes
        now += 1.0
        start = time.perf_counter()
        for snapshot in snapshots:
            _, states[snapshot.tier] = decide(snapshot, policy, states[snapshot.tier], now)
        samples.append((time.perf_counter() - start) * 1000.0)
    samples = sorted(samples[2:])
    p95 = samples[min(len(samples) - 1, round(0.95 * (len(samples) - 1)))]
    return {
        "workers": workers,
        "tiers": tiers,
        "repeats": repeats,
        "median_ms": round(statistics.median(samples), 3),
        "p95_ms": round(p95, 3),
        "per_tier_us": round(statistics.median(samples) / tiers * 1000.0, 1),
    }


if __name__ == "__main__":
    print(json.dumps(bench()))
