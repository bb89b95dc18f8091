"""The monitor's JSON API (``/api/*``): what the page polls, and the dead-letter actions.

Tiers and workers come from the commander's last pass (``Board``: no Redis read for them);
the rest is read through ``stores`` on a blocking client in a worker thread
(``asyncio.to_thread``): every store reader is synchronous, and an asyncio twin of each would
be a second copy of them. A read that fails makes only its own section an ``{"error": ...}``
(logged), never a 500 for the page. Only the leader answers: a standby says who leads, with a
503 and the leader's monitor URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from aiohttp import web

from commander.monitor import views
from commander.monitor.board import KEEP_S, Board
from commander.monitor.views import BadRequest
from protocol.groups import split_pool
from stores.commanders import read_commanders
from stores.deadletters import dead_letter_count, dead_letter_rows, purge_dead_letters, retry_dead_letters
from stores.leader_lease import lease_holder
from stores.ledger import events_since, read_events
from stores.policies import read_policy
from stores.retry import TRANSIENT

log = logging.getLogger("fleet.monitor")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PAGES_CACHED = 16  # worker-list pages kept per pass (a few viewers, each on a page or two)


@dataclass
class Monitor:
    """What the API reads: the commander's board, whether it leads, and a Redis client."""

    board: Board
    leading: Callable[[], bool]
    commander_id: str
    r: redis.Redis | None
    clock: Callable[[], float] = time.time
    timings: dict[str, float] = field(default_factory=dict)  # endpoint -> seconds of its last call
    # (pass, tier, offset, limit) -> a /workers page (of this pass only, PAGES_CACHED at most)
    cache: dict[tuple[int, str | None, int, int], bytes] = field(default_factory=dict)
    rq: redis.Redis | None = None  # RQ's Redis when it is not Fleet's (the commander's rq_url)


MONITOR: web.AppKey[Monitor] = web.AppKey("monitor", Monitor)


class SectionError(Exception):
    """A section of a response could not be read (its one-line reason is shown)."""


def _redis(m: Monitor) -> redis.Redis:
    if m.r is None:
        raise SectionError("no Redis client")
    return m.r


async def section(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``{"data": fn(...)}``, run in a thread; ``{"error": "..."}`` (logged) if it failed, with
    ``"unavailable": True`` if Redis failed it (away, or answering an error: a 503)."""
    try:
        return {"data": await asyncio.to_thread(fn, *args, **kwargs)}
    except Exception as exc:  # noqa: BLE001 - one section's failure is shown in its place, not a 500
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        log.warning("monitor: %s failed: %s", what, reason)
        return {"error": reason, **({"unavailable": True} if isinstance(exc, TRANSIENT) else {})}


def _status(*sections: dict[str, Any], failed: int = 200) -> int:
    """503 if Redis failed one of ``sections``; else ``failed`` if one failed; else 200."""
    if any(s.get("unavailable") for s in sections):
        return 503
    return failed if any("error" in s for s in sections) else 200


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, headers={"Cache-Control": "no-store"})


def _bad(exc: BadRequest) -> web.Response:
    return _json({"error": str(exc)}, 400)


def _leader_info(r: redis.Redis) -> dict[str, Any]:
    return views.leader_json(lease_holder(r), read_commanders(r))


@web.middleware
async def leader_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A standby answers every API call with a 503 naming the leader; errors become JSON."""
    m = request.app[MONITOR]
    if not m.leading():
        who = await section("leader lookup", _leader_info, _redis(m)) if m.r is not None else {}
        info = who.get("data") or {}
        return _json({"error": f"{m.commander_id} is a standby: the leader serves the monitor",
                      "standby": m.commander_id, "leader": info.get("leader"),
                      "leader_url": info.get("leader_url"), "leader_error": who.get("error")}, 503)
    started = time.perf_counter()
    try:
        return await handler(request)
    except BadRequest as exc:
        return _bad(exc)
    except SectionError as exc:
        return _json({"error": str(exc)}, 503)
    finally:
        m.timings[request.path] = time.perf_counter() - started


# --- reads ------------------------------------------------------------------------------
def _no_pass(m: Monitor) -> dict[str, Any]:
    return {"error": f"{m.commander_id} leads but has not finished a pass yet"}


async def overview(request: web.Request) -> web.Response:
    """Tiers (workers vs desired/target, bounds, signals, policy), commanders and the leader."""
    m = request.app[MONITOR]
    seen, now = m.board.seen, m.clock()
    commanders = await section("commanders", lambda r: {"list": read_commanders(r), **_leader_info(r)},
                               _redis(m))
    out: dict[str, Any] = {"commander": m.commander_id, "leading": True, "now": now,
                           "commanders": commanders.get("data") or {"error": commanders["error"]}}
    if seen is None:
        return _json({**out, "tiers": [], "tiers_error": _no_pass(m)["error"]})
    names = sorted(seen.tiers)
    counts = await section("dead-letter counts", lambda r: {t: dead_letter_count(r, t) for t in names},
                           _redis(m))
    dead = counts.get("data") or {}
    grouped = sorted({split_pool(t)[0] for t in names if split_pool(t)[1]})  # their groups' weights
    read = await section("grouped tiers' policies", lambda r: {t: read_policy(r, t).policy for t in grouped},
                         _redis(m))
    policies = read.get("data") or {}
    out["tiers"] = [views.tier_json(seen.tiers[t], dead.get(t), seen.tiers, policies) for t in names]
    out["workers_total"] = sum(t["workers"] for t in out["tiers"])  # /api/workers pages through them
    out["problems"] = views.problems_json(seen, commanders.get("data") or {})
    out["dead_letters_error"] = counts.get("error")
    out["pass_age_s"] = round(max(0.0, now - seen.ts), 2)
    return _json(out)


async def workers(request: web.Request) -> web.Response:
    """``?tier=T&offset=N&limit=K``: one page of the last pass's workers (of tier or pool T), by
    tier then id, each with its occupancy history; ``total`` and ``next_offset`` page on."""
    m = request.app[MONITOR]
    tier = views.tier_param(request.query.get("tier"), pools=True)
    offset = views.offset_param(request.query.get("offset"))
    limit = views.count_param(request.query.get("limit"), views.WORKERS_PAGE, views.WORKERS_PAGE_MAX)
    seen = m.board.seen
    if seen is None:
        return _json({"workers": [], "total": 0, "next_offset": None, **_no_pass(m)})
    key = (seen.generation, tier, offset, limit)
    body = m.cache.get(key)
    if body is None:  # once per pass and page, however many pages are open
        if m.cache and next(iter(m.cache))[0] != seen.generation:
            m.cache.clear()
        while len(m.cache) >= PAGES_CACHED:
            del m.cache[next(iter(m.cache))]
        now = m.clock()
        body = json.dumps({"now": now, **views.workers_page(seen, now, tier, offset, limit)}).encode()
        m.cache[key] = body
    return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})


async def history(request: web.Request) -> web.Response:
    """``?tier=T``: workers and demand over the last hour (samples, then the ledger before); T
    may be a group's pool."""
    m = request.app[MONITOR]
    tier = views.tier_param(request.query.get("tier"), required=True, pools=True)
    assert tier is not None
    now = m.clock()
    since = now - KEEP_S
    samples = m.board.samples(tier, since)
    ledger = await section("ledger", events_since, _redis(m), since, tier)
    chart = views.chart_json(tier, samples, ledger.get("data") or [], since, now)
    return _json({**chart, "ledger_error": ledger.get("error")})


async def ledger(request: web.Request) -> web.Response:
    """``?tier=T&count=N``: the newest ledger entries (of tier or pool T), newest first."""
    m = request.app[MONITOR]
    tier = views.tier_param(request.query.get("tier"), pools=True)
    count = views.count_param(request.query.get("count"), 100, 1000)
    got = await section("ledger", read_events, _redis(m), tier, count)
    if "error" in got:
        return _json({"tier": tier, "events": [], "error": got["error"]}, _status(got))
    return _json({"tier": tier, "events": views.ledger_json(got["data"]),
                  "corrupt": views.corrupt_count(got["data"])})


async def dead_letters(request: web.Request) -> web.Response:
    """``?tier=T&count=N``: the tier's newest dead letters, with their reason."""
    m = request.app[MONITOR]
    tier = views.tier_param(request.query.get("tier"), required=True)
    assert tier is not None
    count = views.count_param(request.query.get("count"), 50, 1000)
    rows = await section("dead letters", _dead_rows, _redis(m), tier, count)
    total = await section("dead-letter count", dead_letter_count, _redis(m), tier)
    error = rows.get("error") or total.get("error")
    return _json({"tier": tier, "total": total.get("data"), "error": error,
                  "dead_letters": rows.get("data") or []}, _status(rows, total))


async def rq_tiers(request: web.Request) -> web.Response:
    """The rq tiers of the last pass: each one's RQ workers (busy or idle, the job in hand, age)
    and queue signals (queued, started, failed, the oldest queued job's age), as ``fleet status``."""
    m = request.app[MONITOR]
    seen = m.board.seen
    if seen is None:
        return _json({"tiers": {}, **_no_pass(m)})
    rq = {t: s.policy.rq_queues(t) for t, s in sorted(seen.tiers.items()) if s.policy.kind == "rq"}
    if not rq:
        return _json({"tiers": {}, "error": None})
    got = await section("rq tiers", _rq_views, m.rq or _redis(m), rq, m.clock())
    return _json({"tiers": got.get("data") or {}, "error": got.get("error")}, _status(got))


async def rq_failed(request: web.Request) -> web.Response:
    """``?queue=Q&count=N``: the queue's newest failed jobs, with their last traceback line."""
    m = request.app[MONITOR]
    queue = views.queue_param(request.query.get("queue"))
    count = views.count_param(request.query.get("count"), 50, 500)
    got = await section("failed jobs", _failed_rows, m.rq or _redis(m), queue, count)
    return _json({"queue": queue, "jobs": got.get("data") or [], "error": got.get("error")}, _status(got))


async def rq_requeue(request: web.Request) -> web.Response:
    """POST ``{queue, ids | all: true}``: put failed jobs back in their queue (as ``fleet jobs
    requeue``); a 409 names ids no longer in the failed registry, and nothing is requeued."""
    m = request.app[MONITOR]
    queue, ids = views.requeue_request(await _json_body(request))
    got = await section("requeue", _requeue, m.rq or _redis(m), queue, ids)
    if "error" in got:
        return _json({"queue": queue, "error": got["error"]}, _status(got, failed=502))
    requeued, missing = got["data"]
    if missing:
        return _json({"queue": queue, "error": missing}, 409)
    log.info("monitor: requeued %d failed job(s) of queue %s", len(requeued), queue)
    return _json({"queue": queue, "requeued": requeued})


def _failed_rows(r: redis.Redis, queue: str, count: int) -> list[dict[str, Any]]:
    from stores.rqview import failed_rows  # the rq extra: only with an rq tier

    return failed_rows(r, queue, count)


def _requeue(r: redis.Redis, queue: str, ids: list[str] | None) -> tuple[list[str], str | None]:
    from stores import rqjobs  # the rq extra

    try:
        return rqjobs.requeue(r, queue, ids), None
    except KeyError as exc:  # an id gone since the page listed it (requeued, or deleted)
        return [], str(exc.args[0])


def _rq_views(r: redis.Redis, queues: dict[str, tuple[str, ...]], now: float) -> dict[str, Any]:
    from stores.rqview import tier_view  # the rq extra: only with an rq tier

    return {tier: tier_view(r, qs, now) for tier, qs in queues.items()}


def _dead_rows(r: redis.Redis, tier: str, count: int) -> list[dict[str, Any]]:
    return views.dead_letter_json(row.to_json() for row in dead_letter_rows(r, tier, count))


def _active_users(r: redis.Redis, tier: str, limit: int) -> list[Any]:
    from stores.users import active_users  # (imported when used: the other views need none of it)

    return [views.plain(u) for u in active_users(r, tier, limit=limit)]


async def population(request: web.Request) -> web.Response:
    """``?tier=T&q=search&sort=col``: the tier's active users and what each consumes."""
    m = request.app[MONITOR]
    tier = views.tier_param(request.query.get("tier"), required=True)
    assert tier is not None
    q, sort = request.query.get("q", ""), request.query.get("sort", "turns")
    views.population([], q, sort)  # a bad sort column is a 400 before any read
    got = await section("population", _active_users, _redis(m), tier, 500)
    if "error" in got:
        return _json({"tier": tier, "users": [], "error": got["error"]}, _status(got))
    rows = views.population(got["data"], q, sort)
    return _json({"tier": tier, "q": q, "sort": sort, "users": rows, "total": len(got["data"])})


def _inspect(r: redis.Redis, user: str) -> Any:
    from stores.users import inspect_user

    return views.plain(inspect_user(r, user))


async def user(request: web.Request) -> web.Response:
    """``/api/users/{user}``: lane holder, inbox after the cursor, last turns, dead letters."""
    m = request.app[MONITOR]
    uid = views.user_param(request.match_info["user"])
    got = await section("user", _inspect, _redis(m), uid)
    return _json({"user": uid, **({"error": got["error"]} if "error" in got else {"view": got["data"]})},
                 _status(got))


# --- actions ----------------------------------------------------------------------------
async def _json_body(request: web.Request) -> Any:
    if request.content_type != "application/json":
        raise BadRequest("send the body as application/json")
    try:
        return await request.json()
    except ValueError:
        raise BadRequest("the body is not valid JSON") from None


async def _body(request: web.Request) -> tuple[str, list[str] | None]:
    return views.dead_letter_request(await _json_body(request))


def _retry(r: redis.Redis, tier: str, ids: list[str] | None) -> list[Any]:
    return [views.plain(x) for x in retry_dead_letters(r, tier, ids)]


def _purge(r: redis.Redis, tier: str, ids: list[str] | None) -> int:
    return int(purge_dead_letters(r, tier, ids))


async def retry(request: web.Request) -> web.Response:
    """POST ``{tier, ids | all: true}``: re-enqueue the dead letters' turns (idempotent)."""
    m = request.app[MONITOR]
    tier, ids = await _body(request)
    got = await section("retry", _retry, _redis(m), tier, ids)
    if "error" in got:
        return _json({"tier": tier, "error": got["error"]}, _status(got, failed=502))
    summary = views.retry_summary(got["data"])
    log.info("monitor: dead letters of tier %s: %s", tier, summary)
    return _json({"tier": tier, "retried": got["data"], "summary": summary})


async def purge(request: web.Request) -> web.Response:
    """POST ``{tier, ids | all: true}``: delete dead letters for good."""
    m = request.app[MONITOR]
    tier, ids = await _body(request)
    got = await section("purge", _purge, _redis(m), tier, ids)
    if "error" in got:
        return _json({"tier": tier, "error": got["error"]}, _status(got, failed=502))
    log.info("monitor: purged %d dead letter(s) of tier %s", got["data"], tier)
    return _json({"tier": tier, "purged": got["data"]})


def api_app(monitor: Monitor) -> web.Application:
    """The ``/api`` sub-application."""
    app = web.Application(middlewares=[leader_only])
    app[MONITOR] = monitor
    app.router.add_get("/overview", overview)
    app.router.add_get("/workers", workers)
    app.router.add_get("/history", history)
    app.router.add_get("/ledger", ledger)
    app.router.add_get("/dead-letters", dead_letters)
    app.router.add_get("/rq", rq_tiers)
    app.router.add_get("/rq/failed", rq_failed)
    app.router.add_post("/rq/requeue", rq_requeue)
    app.router.add_post("/dead-letters/retry", retry)
    app.router.add_post("/dead-letters/purge", purge)
    app.router.add_get("/population", population)
    app.router.add_get("/users/{user}", user)
    return app
