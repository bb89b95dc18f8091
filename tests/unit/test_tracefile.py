"""Reading any trace: timestamps, BOM, column mapping, JSON lines, rate-only rows, service models."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sim.scaling.service import ServiceModel, parse_service
from sim.scaling.trace import Request, TraceModel, assign_users, read_trace, service_times
from sim.scaling.tracefile import (
    Columns,
    TraceSource,
    arrivals_from_counts,
    parse_columns,
    parse_ts,
    read_trace_file,
    zone,
)

UTC_ZONE = zone("UTC")
T0 = datetime(2023, 11, 16, 18, 15, 46, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "tz", "expected"),
    [
        ("2023-11-16 18:15:46", "UTC", T0),
        ("2023-11-16T18:15:46Z", "UTC", T0),
        ("2023-11-16t18:15:46z", "UTC", T0),
        ("2023-11-16 18:15:46.6805900", "UTC", T0 + 0.68059),  # seven fractional digits
        ("2023-11-16T18:15:46,5Z", "UTC", T0 + 0.5),
        ("2023-11-16T19:15:46+01:00", "UTC", T0),
        ("2023-11-16T13:15:46-0500", "UTC", T0),
        ("2023-11-16 19:15:46", "Europe/Paris", T0),  # naive: read in the given zone (CET)
        ("2023-07-16 20:15:46", "Europe/Paris", T0 - 123 * 86400),  # summer time: UTC+2
        ("2023-11-16T18:15", "UTC", T0 - 46),
        (f"{T0:.3f}", "UTC", T0),  # a unix time as text
        (T0, "UTC", T0),  # ... or as a number
    ],
)
def test_timestamps(text: object, tz: str, expected: float) -> None:
    assert parse_ts(text, unit="s", tz=zone(tz), start=0.0) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("value", "unit", "start", "expected"),
    [
        (27482, "ms", 0.0, 27.482),  # relative milliseconds (Mooncake)
        (27482, "ms", T0, T0 + 27.482),
        (5.5, "s", 100.0, 105.5),
        (T0 * 1000, "ms", 0.0, T0),  # absolute milliseconds
        (T0 * 1e6, "us", 0.0, T0),
    ],
)
def test_numeric_timestamps_absolute_or_relative(value: float, unit: str, start: float,
                                                 expected: float) -> None:
    assert parse_ts(value, unit=unit, tz=UTC_ZONE, start=start) == pytest.approx(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["yesterday", "2023-13-01 00:00:00", "nan", "", True])
def test_bad_timestamps_are_errors(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_ts(bad, unit="s", tz=UTC_ZONE, start=0.0)


def test_unknown_zone_is_named() -> None:
    with pytest.raises(ValueError, match="Mars/Olympus"):
        zone("Mars/Olympus")


def write(tmp_path: Path, name: str, text: str, bom: bool = False) -> Path:
    path = tmp_path / name
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


def test_azure_csv_with_a_bom_reads_as_without(tmp_path: Path) -> None:
    body = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:50.5,396,109\n2023-11-16 18:15:46,374,44\n")
    plain = read_trace(write(tmp_path, "a.csv", body))
    assert read_trace(write(tmp_path, "b.csv", body, bom=True)) == plain
    assert [(r.context_tokens, r.generated_tokens) for r in plain] == [(374, 44), (396, 109)]
    assert plain[0].ts == pytest.approx(T0)


def test_column_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "when,prompt,answer,other\n2023-11-16T18:15:46Z,10,20,x\n")
    cols = parse_columns("ts=when,in=prompt,out=answer")
    trace = read_trace_file(TraceSource(path, cols, name="mine"))
    assert trace.requests == [Request(T0, 10, 20)] and trace.name == "mine" and trace.has_lengths
    with pytest.raises(ValueError, match="no column 'nope'"):
        read_trace_file(TraceSource(path, Columns(ts="nope")))
    with pytest.raises(ValueError, match="no timestamp column"):
        read_trace_file(TraceSource(write(tmp_path, "u.csv", "a,b\n1,2\n")))


@pytest.mark.parametrize("bad", ["ts", "time=x", "ts=", "in=a,=b"])
def test_bad_column_mappings(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_columns(bad)


def test_jsonl_in_milliseconds_relative_to_a_start(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 100, "output_length": 7}]
    path = write(tmp_path, "mooncake.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = read_trace_file(TraceSource(path, start=T0))
    assert trace.requests == [Request(T0, 6955, 52), Request(T0 + 1.5, 100, 7)]
    assert trace.name == "mooncake" and trace.epoch == T0
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        read_trace_file(TraceSource(write(tmp_path, "bad.jsonl", '{"timestamp": 1}\n{oops\n')))


def test_a_bad_row_names_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,2\n"
                 "2023-11-16 18:15:47,,2\n")
    with pytest.raises(ValueError, match=r"t\.csv:3: empty ContextTokens"):
        read_trace_file(TraceSource(path))


def test_rate_only_rows_become_exactly_that_many_arrivals(tmp_path: Path) -> None:
    path = write(tmp_path, "rate.csv", "minute,count\n"
                 "2024-01-01T00:00:00Z,120\n2024-01-01T00:01:00Z,0\n2024-01-01T00:02:00Z,30\n")
    trace = read_trace_file(TraceSource(path, parse_columns("ts=minute,count=count"), seed=3))
    start = datetime(2024, 1, 1, tzinfo=UTC).timestamp()
    minutes = [int((r.ts - start) // 60) for r in trace.requests]
    assert [minutes.count(m) for m in range(3)] == [120, 0, 30]  # the counts, exactly
    assert not trace.has_lengths and "60 s windows" in trace.arrivals
    again = read_trace_file(TraceSource(path, parse_columns("ts=minute,count=count"), seed=3))
    other = read_trace_file(TraceSource(path, parse_columns("ts=minute,count=count"), seed=4))
    assert again.requests == trace.requests and other.requests != trace.requests  # seeded


def test_fractional_counts_round_by_chance() -> None:
    got = arrivals_from_counts([(float(i), 0.25) for i in range(4000)], 1.0, seed=1)
    assert 850 < len(got) < 1150


def test_a_user_column_keeps_the_traces_users(tmp_path: Path) -> None:
    path = write(tmp_path, "u.csv", "ts,in,out,conversation_id\n0,1,1,a\n1,1,1,b\n2,1,1,a\n")
    trace = read_trace_file(TraceSource(path, parse_columns("in=in,out=out"), start=T0))
    turns = assign_users(trace.requests, TraceModel())
    assert [(t.user, t.turn) for t in turns] == [("a", 0), ("b", 0), ("a", 1)]


@pytest.mark.parametrize(
    ("text", "model"),
    [
        ("tokens", ServiceModel()),
        ("const:2.5", ServiceModel("const", 2.5)),
        ("lognormal:2,1.2", ServiceModel("lognormal", 2.0, 1.2)),
        ("pareto:0.5,1.5,600", ServiceModel("pareto", 0.5, 1.5, 600.0)),
    ],
)
def test_service_model_specs(text: str, model: ServiceModel) -> None:
    assert parse_service(text) == model and parse_service(model.spec()) == model


@pytest.mark.parametrize("bad", ["gamma:1", "const", "const:0", "lognormal:2", "pareto:1,-1", "const:x"])
def test_bad_service_specs(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_service(bad)


def test_random_service_times_are_seeded_and_heavy_tailed() -> None:
    reqs = [Request(float(i), 0, 0) for i in range(20_000)]
    model = TraceModel(service=parse_service("pareto:0.5,1.5"), seed=5)
    times = service_times(reqs, model)
    assert times == service_times(reqs, model) and min(times) >= 0.5
    ordered = sorted(times)
    assert ordered[-200] > 10 * ordered[len(ordered) // 2]  # the p99 is far above the median
    capped = service_times(reqs, TraceModel(service=parse_service("pareto:0.5,1.5,30")))
    assert max(capped) == 30.0
    assert ServiceModel("const", 2.0).draw_s(random.Random(0)) == 2.0
