"""The trace model and the discrete-event simulator, on tiny synthetic traces."""

from __future__ import annotations

import math

import pytest

from protocol.policy import turns_policy
from sim.scaling.policies import (
    FleetDecide,
    Static,
    hpa_like,
    keda_like,
    oracle_schedule,
    peak_static_workers,
)
from sim.scaling.replay import check_loopback
from sim.scaling.simulate import Scale, SimConfig, Simulator, simulate
from sim.scaling.trace import (
    Request,
    TraceModel,
    TraceTurn,
    assign_users,
    read_trace,
    service_ms,
    speed_up,
    window,
)


def requests(n: int, every: float = 0.5, ctx: int = 500, gen: int = 100) -> list[Request]:
    return [Request(1_700_000_000.0 + i * every, ctx + i % 7, gen + i % 5) for i in range(n)]


def turns(spec: list[tuple[float, str, float]]) -> list[TraceTurn]:
    """(at, user, service_s) rows -> turns, in arrival order."""
    return [TraceTurn(i, at, user, 0, s) for i, (at, user, s) in enumerate(sorted(spec))]


# --- the trace model --------------------------------------------------------------------
def test_read_trace_parses_the_azure_format(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:46.6805900,374,44\n")
    rows = read_trace(path)
    assert [r.context_tokens for r in rows] == [374, 396]  # sorted by time
    assert rows[1].ts - rows[0].ts == pytest.approx(4.314579, abs=1e-5)


def test_read_trace_rejects_a_bad_row(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(ValueError, match=":2:"):
        read_trace(path)


def test_user_assignment_keeps_each_users_turns_in_order_and_apart():
    model = TraceModel()
    out = assign_users(requests(2000, every=0.2), model)
    assert [t.index for t in out] == list(range(2000))
    by_user: dict[str, list[TraceTurn]] = {}
    for t in out:
        by_user.setdefault(t.user, []).append(t)
    assert 1.5 < len(out) / len(by_user) < 5  # geometric, mean 3.5, the trace's tail cut short
    for mine in by_user.values():
        assert [t.turn for t in mine] == list(range(len(mine)))
        for prev, nxt in zip(mine, mine[1:], strict=False):
            assert nxt.at >= prev.at + prev.service_s + model.think_min_s


def test_service_times_are_positive_and_follow_the_tokens():
    model = TraceModel()
    assert service_ms(0, 0, model) > 0
    assert service_ms(1000, 100, model) == pytest.approx(50 + 200 + 2500)
    assert service_ms(1000, 100, TraceModel(service_scale=0.5)) == pytest.approx(1375)
    assert all(t.service_s > 0 for t in assign_users(requests(300), model))


def test_assignment_is_deterministic_and_seeded():
    a = assign_users(requests(500), TraceModel(seed=3))
    assert a == assign_users(requests(500), TraceModel(seed=3))
    assert [t.user for t in a] != [t.user for t in assign_users(requests(500), TraceModel(seed=4))]


def test_window_and_speed_up_retime_the_slice():
    out = assign_users(requests(100, every=1.0))
    cut = window(out, 10, 20, limit=5)
    assert [t.index for t in cut] == list(range(5)) and cut[0].at == 0.0
    fast = speed_up(cut, 10)
    assert fast[1].at == pytest.approx(cut[1].at / 10)
    assert fast[1].service_s == pytest.approx(cut[1].service_s / 10)


# --- the simulator ----------------------------------------------------------------------
def test_static_with_enough_workers_never_waits():
    spec = [(i * 0.1, f"u{i}", 2.0) for i in range(100)]  # 20 turns in service at most
    result = simulate(turns(spec), Static(3), SimConfig(concurrency=8))
    assert result.summary()["p99_wait_s"] == 0.0 and result.summary()["unserved"] == 0
    assert result.worker_seconds == pytest.approx(3 * spec[-1][0])


def test_too_few_workers_queue_in_fifo_order():
    spec = [(0.0, f"u{i}", 1.0) for i in range(10)]
    result = simulate(turns(spec), Static(1), SimConfig(concurrency=2))
    assert sorted(result.waits) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert result.waits == sorted(result.waits)  # first come, first served


def test_a_users_next_turn_waits_for_the_previous_one():
    spec = [(0.0, "alice", 3.0), (1.0, "alice", 1.0), (1.0, "bob", 1.0)]
    result = simulate(turns(spec), Static(1), SimConfig(concurrency=4))
    waits = dict(zip([t.user + str(t.at) for t in turns(spec)], result.waits, strict=True))
    assert waits == {"alice0.0": 0.0, "alice1.0": 2.0, "bob1.0": 0.0}


def burst_trace() -> list[TraceTurn]:
    quiet = [(float(t), f"q{t}", 0.5) for t in range(0, 240)]
    burst = [(30.0 + i * 0.01, f"b{i}", 5.0) for i in range(120)]
    return turns(quiet + burst)


def test_decide_scales_up_on_a_burst_and_down_after_the_stabilization_window():
    policy = turns_policy(handler="sleep", concurrency=8, max_workers=20, report_interval_s=1.0,
                          scale_down_stabilization_s=30.0)
    cfg = SimConfig(concurrency=8, view_policy=policy)
    result = simulate(burst_trace(), FleetDecide(policy), cfg)
    summary = result.summary()
    assert summary["scale_ups"] >= 1 and summary["peak_workers"] >= 8
    assert summary["scale_downs"] >= 1
    at = {round(t): n for t, n, *_ in result.timeline}
    assert at[29] == 1  # before the burst: the floor
    assert max(at[t] for t in range(31, 40)) >= 8  # up within seconds
    assert at[60] >= 8  # held through the stabilization window
    assert at[230] <= 2  # and back down after it
    assert summary["p99_wait_s"] < 5.0


def test_same_inputs_same_result():
    policy = turns_policy(handler="sleep", concurrency=4, max_workers=10, report_interval_s=1.0)
    a = simulate(burst_trace(), FleetDecide(policy), SimConfig(concurrency=4, view_policy=policy))
    b = simulate(burst_trace(), FleetDecide(policy), SimConfig(concurrency=4, view_policy=policy))
    assert a.waits == b.waits and a.timeline == b.timeline


@pytest.mark.parametrize("policy", [hpa_like(max_replicas=20), keda_like(max_replicas=20)])
def test_baselines_scale_up_on_a_burst(policy):
    result = simulate(burst_trace(), policy, SimConfig(concurrency=8))
    assert result.summary()["peak_workers"] > 1 and result.summary()["unserved"] == 0


def test_oracle_meets_the_slo_with_fewer_workers_than_the_peak():
    trace = burst_trace()
    cfg = SimConfig(concurrency=8, spawn_delay_s=0.0)
    schedule = oracle_schedule(trace, cfg, max_workers=20)
    result = simulate(trace, schedule, cfg)
    assert result.summary()["p99_wait_s"] <= 1.0
    peak = peak_static_workers(trace, 8)
    assert result.worker_seconds < simulate(trace, Static(peak), cfg).worker_seconds


def test_fork_is_independent():
    sim = Simulator(burst_trace(), Static(1), SimConfig(concurrency=8))
    sim.run_until(31.0)
    other = sim.fork()
    other.run_until(100.0)
    assert sim.t < 31.0 <= other.t
    served = [sum(not math.isnan(w) for w in s.wait) for s in (sim, other)]
    assert served[0] < served[1]
    sim.run_until(100.0)
    assert [repr(w) for w in sim.wait] == [repr(w) for w in other.wait]  # the copy went the same way


def test_replay_refuses_a_remote_redis():
    check_loopback("redis://127.0.0.1:6379/0")
    check_loopback("unix:///tmp/redis.sock")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("redis://redis.example.com:6379/0")


# --- the sensor: handler time credited as it runs -----------------------------------------
class _Watch:
    """An observing policy that never scales: the simulated reports flow, nothing else moves."""

    name, observes, wakes_on_pressure = "watch", True, False

    def initial_workers(self) -> int:
        return 1

    def due(self, now: float) -> bool:
        return True

    def __call__(self, now: float, snap: object, current: int) -> Scale:
        return Scale()


@pytest.mark.parametrize("service_s", [2.0, 12.0, 60.0])
def test_a_fully_busy_worker_reads_occupancy_one_whatever_the_turn_length(service_s: float) -> None:
    """Both slots busy from 0 to 60 s with turns of ``service_s``: every reading is 1.0, as the
    real worker's counters (``counters_now``) make it, even for turns longer than the report
    interval (5 s), which the simulator used to credit only when they ended."""
    per_user = int(60 / service_s)
    spec = [(0.0, user, service_s) for user in ("a", "b") for _ in range(per_user)]
    sim = Simulator(turns(spec), _Watch(), SimConfig(concurrency=2))
    readings = []
    for t in (31.0, 41.0, 51.0, 59.0):
        sim.run_until(t)
        (wid,) = sim.workers
        assert sim.evaluator is not None
        readings.append(sim.evaluator.occupancy(wid).slots)
    assert readings == [pytest.approx(1.0)] * 4
    assert all(r is not None and r <= 1.0 for r in readings)  # capped, as the evaluator caps a row


def test_a_half_busy_worker_reads_one_half_with_long_turns() -> None:
    spec = [(0.0, "a", 30.0), (30.0, "a", 30.0)]  # one of two slots, the whole minute
    sim = Simulator(turns(spec), _Watch(), SimConfig(concurrency=2))
    sim.run_until(45.0)
    assert sim.evaluator is not None
    assert sim.evaluator.occupancy(next(iter(sim.workers))).slots == pytest.approx(0.5)


# --- the policy controls, simulated -------------------------------------------------------
def steady(seconds: int, every: float = 0.25, service: float = 2.0) -> list[TraceTurn]:
    return turns([(i * every, f"u{i}", service) for i in range(int(seconds / every))])


def test_a_report_outage_triggers_the_fallback_and_no_scale_in() -> None:
    pol = turns_policy(handler="sleep", concurrency=8, max_workers=10, report_interval_s=1.0,
                       scale_down_stabilization_s=0.0, fallback={"after": 4, "action": "fixed", "workers": 5})
    cfg = SimConfig(concurrency=8, view_policy=pol, report_outages=((30.0, 60.0),))
    result = simulate(steady(90), FleetDecide(pol), cfg)
    at = {round(t): n for t, n, *_ in result.timeline}
    assert at[25] <= 2  # the load needs one or two workers
    assert max(at[t] for t in range(36, 60)) == 5  # reports stale (3 s): the fallback goes to 5
    assert min(at[t] for t in range(36, 60)) >= at[33]  # and never scales in on missing data
    assert result.summary()["unserved"] == 0


def test_recycling_by_turns_keeps_serving() -> None:
    pol = turns_policy(handler="sleep", concurrency=8, max_workers=10, report_interval_s=1.0,
                       max_turns_per_worker=60)
    result = simulate(steady(120), FleetDecide(pol), SimConfig(concurrency=8, view_policy=pol))
    s = result.summary()
    assert s["retired"] >= 3 and s["unserved"] == 0 and s["p99_wait_s"] < 0.2


class _Recording(Simulator):
    """A simulator that notes when each worker was told to drain."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.drained: dict[str, float] = {}

    def _retire(self, wid: str) -> None:
        self.drained.setdefault(wid, self.t)
        super()._retire(wid)


@pytest.mark.parametrize(("protect", "kept"), [(30.0, True), (None, False)])
def test_a_protected_long_turn_keeps_its_worker(protect: float | None, kept: bool) -> None:
    """A burst scales the tier up; the worker running a 60 s turn that protects it is never
    drained while the turn runs (without protection it is consolidated: its load fits)."""
    pol = turns_policy(handler="sleep", concurrency=4, max_workers=4, report_interval_s=1.0,
                       scale_down_stabilization_s=0.0, users_per_instance=None, compaction_margin=1.0)
    spec = [(0.0, f"b{i}", 3.0) for i in range(12)] + [(0.5, "long", 60.0)]
    sim = _Recording(turns(spec), FleetDecide(pol),
                     SimConfig(concurrency=4, view_policy=pol, protect_turns_over_s=protect))
    sim.run_until(1.0)
    holder = sim.user_worker["long"]
    sim.run_until(59.0)
    assert (holder not in sim.drained) is kept, sim.drained
    assert sim.run().summary()["unserved"] == 0
