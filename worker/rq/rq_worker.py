"""Fleet's RQ worker: an ``rq.SimpleWorker`` that runs only Fleet's registered jobs.

``python -m worker.rq.rq_worker --queues writeback[,eval] [--name N]`` (or ``fleet rq-worker``).

- *The allowlist.* RQ imports a job's function from the dotted path in the job's hash, so
  anyone who can write to Redis could make a plain ``rq worker`` run any importable function.
  Here a job's function must be ``worker.jobs.run`` (:class:`FleetJob` refuses any other: the
  job fails, with the reason in RQ's failed registry), which runs only a name registered in
  ``worker.jobs``; and jobs are JSON, never RQ's default serializer.
- *No fork per job* (``SimpleWorker``): the job runs in this process, so a SIGKILL of the
  worker ends its job too (no orphaned work-horse), and a job costs no fork.
- *Retiring*: SIGTERM is RQ's warm shutdown (the current job finishes, then the worker exits);
  a second SIGTERM is its cold shutdown, whenever it comes (``scripts/rq_sigterm`` checks it).
  RQ's own gaps closed here:
  - a stop before RQ installs its handler (it registers the worker and forks its scheduler
    first) is held from ``run()``'s start, not fatal: before registering, the worker exits at
    once; later, the stop is raised inside RQ's loop (``FleetWorker.request_stop``), whose
    teardown deregisters the worker and stops its scheduler. RQ's handler would raise it
    before the loop's ``try``, skipping the teardown;
  - a forked child (the scheduler process) gets the default stop signals, not the held ones,
    so a SIGTERM sent to it before it installs its own ends it; and a scheduler process that
    outlives ``work()`` anyway is stopped (``end_scheduler``); the scheduler is signalled until it
    ends, then killed (``FleetWorker.stop_scheduler``): RQ's one SIGTERM can be lost, and its
    join would then wait for ever;
  - the pub/sub thread is told to stop *before* the UNSUBSCRIBE whose reply wakes it, so
    stopping it never waits for its 60 s poll (RQ stops it after, and redis-py 8's ``stop()``
    waits for it).
- RQ's scheduler runs in it (``with_scheduler``): delayed deferrals and retry intervals are
  moved to their queue when due, by whichever worker holds the scheduler's lock.
- *In a pod* (``FLEET_WORKER_POD_NAME`` set by the downward API, no ``--name``) its RQ name is the
  pod's name: the ``kubernetes`` runtime knows a pod's RQ worker by it. A pod runs one container
  at a time, so an RQ worker registered under that name when this one starts is its previous
  container's, which died without deregistering (killed, OOM): its job is handed back to RQ
  (retried if it has retries left, else failed) and its entry removed before this one registers
  (RQ would refuse the name until the dead one's key expired, minutes later).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import signal
import sys
import time
import uuid
from types import FrameType
from typing import Any

import redis
import setproctitle
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now

from stores import rqjobs
from stores.connection import connect_sync
from stores.redis_errors import RedisErrors
from stores.registry import rq_registered
from stores.retry import TRANSIENT, Backoff
from stores.roles import as_role
from worker import jobs

log = logging.getLogger("fleet.rq")
POD_NAME_ENV = "FLEET_WORKER_POD_NAME"  # the pod's name (Kubernetes' downward API), as a chat worker's
MAINTENANCE_INTERVAL_S = 30  # RQ's registry cleanup (RQ's default: 10 minutes)
SCHEDULER_STOP_S = 5.0  # a scheduler process being stopped gets this long, then SIGKILL
SCHEDULER_SIGNAL_EVERY_S = 0.2  # ... and a SIGTERM this often until then
PUBSUB_JOIN_S = 2.0  # how long a shutdown waits for the pub/sub thread once it was told to stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_BACKOFF = Backoff(base=0.05, cap=2.0)  # a Redis error under the dequeue: waits up to 2 s, then again
_early_stop: list[int] = []  # the stop signals received before RQ's handlers were installed
_fork_hook: list[bool] = []  # the at-fork hook is registered (once per process)


def remember_stop(signum: int, frame: FrameType | None) -> None:
    """The stop signals' handler until RQ installs its own: remember the request."""
    _early_stop.append(signum)


def hold_stop_signals() -> None:
    """From now until the worker's loop starts, a SIGTERM or SIGINT is held, not fatal. A forked
    child (RQ's scheduler process) starts with the default handlers instead: it installs its own
    at once, and a stop sent before that must end it, not be held in its copy of this process."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, remember_stop)
    if not _fork_hook:
        os.register_at_fork(after_in_child=_default_stop_signals)
        _fork_hook.append(True)


def _default_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


class UnsafeJob(Exception):
    """A job in a Fleet queue names a function other than ``worker.jobs.run``."""


class FleetJob(Job):
    """A job whose function can only be :func:`worker.jobs.run`."""

    @property
    def func(self) -> Any:
        if self.func_name != jobs.ENTRY:
            raise UnsafeJob(f"job {self.id} names function {self.func_name!r}: Fleet's RQ workers run "
                            f"only {jobs.ENTRY} (a registered job name in its arguments)")
        return jobs.run


class FleetWorker(SimpleWorker):
    """RQ's in-process worker with Fleet's job class and serializer, and a shutdown that
    neither loses an early SIGTERM nor waits on its pub/sub thread (see the module's doc)."""

    job_class = FleetJob
    _looping = False  # RQ's loop asked for a job: its ``try`` (and teardown) is around us now

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.redis_errors = RedisErrors(log)  # each kind logged once until Redis answers again

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()  # type: ignore[no-untyped-call]
        if _early_stop:  # asked to stop while RQ was starting
            self.request_stop(_early_stop[0], None)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """RQ's warm shutdown; before RQ's loop, a stop held for the loop's first check. (RQ's
        handler raises StopRequested when idle: before the loop's ``try`` that escapes ``work()``
        with no teardown, and the scheduler process, never stopped, is joined at exit for ever.)"""
        if self._looping:
            super().request_stop(signum, frame)  # type: ignore[no-untyped-call]
            return
        self.log.info("Worker %s: stop signal %s received while starting: stopping",
                      self.name, signal.Signals(signum).name)
        self._shutdown_requested_date = rq_now()
        for sig in STOP_SIGNALS:  # a second signal is a cold shutdown, as in RQ
            signal.signal(sig, self.request_force_stop)
        self._stop_requested = True

    def stop_scheduler(self) -> None:
        """RQ's teardown of the scheduler process, bounded: SIGTERM again until it ends (CPython
        drops a signal the forked child receives before its fork hook runs, and one that arrives
        between the hook and the scheduler's own handler finds none to run: RQ's one SIGTERM and
        unbounded join then waited for ever), SIGKILL after ``SCHEDULER_STOP_S``; the locks it
        holds are released (a killed one cannot)."""
        proc = self.scheduler._process if self.scheduler is not None else None
        if proc is None or proc.pid is None:
            return
        deadline = time.monotonic() + SCHEDULER_STOP_S
        while proc.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            proc.join(SCHEDULER_SIGNAL_EVERY_S)
        if proc.is_alive():
            log.warning("rq-worker: its scheduler process ignored SIGTERM for %.0f s: killing it",
                        SCHEDULER_STOP_S)
            proc.kill()
            proc.join()
        try:
            self.scheduler.release_locks()  # only the locks still under its name
        except redis.RedisError as e:  # they expire on their own (RQ's lock TTL)
            log.warning("rq-worker: could not release its scheduler's locks: %s", e)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None,
                                     max_idle_time: int | None = None) -> tuple[Job, Queue] | None:
        """RQ's dequeue, retried on a Redis error RQ does not retry itself (BUSY, NOPERM,
        READONLY, LOADING, ...: RQ's loop quits on them); each kind is logged once."""
        self._looping = True
        failures = 0
        while True:
            if self._stop_requested:  # held since before the loop, or since the loop's own check
                raise StopRequested()
            try:
                got = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except TRANSIENT as exc:
                failures += 1
                self.redis_errors.failed("dequeue", exc)
                self._pause(_BACKOFF.compute(failures))
                continue
            self.redis_errors.answered("dequeue")
            return got

    def check_for_suspension(self, burst: bool) -> None:
        """RQ's check for ``rq suspend``; a Redis error is not a suspension: logged once per
        kind, and the loop goes on to its dequeue, which waits Redis out."""
        try:
            super().check_for_suspension(burst)
        except TRANSIENT as exc:
            self.redis_errors.failed("suspension check", exc)
        else:
            self.redis_errors.answered("suspension check")

    def run_maintenance_tasks(self) -> None:
        """RQ's registry cleanup and scheduler check; one that meets a Redis error is skipped
        (logged once per kind) and runs at the next interval."""
        try:
            super().run_maintenance_tasks()  # type: ignore[no-untyped-call]
        except TRANSIENT as exc:
            self.redis_errors.failed("maintenance", exc)
        else:
            self.redis_errors.answered("maintenance")

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, in slices so a stop request ends it within a tenth of a second."""
        end = time.monotonic() + seconds
        while not self._stop_requested and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))

    def unsubscribe(self) -> None:
        thread, pubsub = self.pubsub_thread, self.pubsub
        if thread is None or pubsub is None:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        _clear_run_flag(thread)
        try:
            pubsub.unsubscribe()  # its reply wakes the thread, which sees the flag and ends
        except redis.RedisError as exc:  # Redis gone: the thread's read fails and it ends too
            self.log.warning("Worker %s: unsubscribe failed (%s); closing the connection", self.name, exc)
        thread.join(timeout=PUBSUB_JOIN_S)
        if thread.is_alive():
            self.log.warning("Worker %s: the pub/sub thread still runs after %.0f s; exiting without it "
                             "(a daemon thread)", self.name, PUBSUB_JOIN_S)
        pubsub.close()


def _clear_run_flag(thread: Any) -> None:
    """Tell redis-py's pub/sub thread to end its loop, without waiting for it (redis-py 8's
    ``stop()`` also joins the thread, for ever unless given a timeout; older ones only clear)."""
    if "timeout" in inspect.signature(thread.stop).parameters:
        thread.stop(timeout=0)
    else:
        thread.stop()


def build(conn: redis.Redis, queues: list[str], name: str | None = None) -> FleetWorker:
    """A worker on ``queues`` (Fleet's serializer, allowlist and maintenance interval)."""
    return FleetWorker(queues, name=name or f"rq-{uuid.uuid4().hex[:8]}", connection=conn,
                       job_class=FleetJob, serializer=JSONSerializer,
                       maintenance_interval=MAINTENANCE_INTERVAL_S, worker_ttl=rqjobs.RQ_WORKER_TTL_S)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--queues", required=True, help="comma-separated RQ queues to consume, in priority order")
    p.add_argument("--name", help=f"the worker's name in RQ's registry (default: the pod's name, "
                                  f"${POD_NAME_ENV}, in a pod; else random)")
    p.add_argument("--rq-url", help="RQ's Redis (default: $FLEET_RQ_URL, else $REDIS_URL)")
    p.add_argument("--burst", action="store_true", help="exit once the queues are empty")


def run(args: argparse.Namespace) -> int:
    """Work until SIGTERM (warm shutdown) or, with ``--burst``, until the queues are empty."""
    hold_stop_signals()
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    if not queues:
        print("rq-worker: --queues names no queue", file=sys.stderr)
        return 2
    # Fleet's Redis as the worker's role (stores.roles); RQ's own node takes its URL as given
    fleet_url = as_role(os.environ["REDIS_URL"], "fleet-worker") if os.environ.get("REDIS_URL") else None
    rq_url = args.rq_url or os.environ.get("FLEET_RQ_URL")
    url = rq_url or fleet_url
    if not url:
        print("rq-worker: no Redis: pass --rq-url or set REDIS_URL", file=sys.stderr)
        return 2
    if fleet_url and rq_url and rq_url != os.environ.get("REDIS_URL"):  # RQ on a node of its own
        jobs.use_fleet_redis(connect_sync(fleet_url))
    pod = None if args.name else os.environ.get(POD_NAME_ENV) or None
    name = args.name or pod
    setproctitle.setproctitle(f"fleet-rq-worker {','.join(queues)} {name or ''}".rstrip())
    conn = redis.Redis.from_url(url)
    if pod is not None:
        reap_predecessor(conn, pod, queues)
    if _early_stop:  # retired before it registered: nothing to undo
        print("rq-worker: stop signal received while starting: exiting before registering", file=sys.stderr)
        return 0
    w = build(conn, queues, name)
    try:
        w.work(burst=args.burst, with_scheduler=True, logging_level="INFO")
    finally:
        end_scheduler(w)
    return 0


def end_scheduler(w: FleetWorker) -> None:
    """Stop the worker's scheduler process if it still runs: RQ stops it in its loop's teardown,
    which an error while RQ starts skips, and the process (not a daemon) would then be waited
    for at exit, for ever."""
    proc = getattr(w.scheduler, "_process", None)
    if proc is not None and proc.is_alive():
        log.warning("rq-worker: its scheduler process outlived the worker's loop: stopping it")
        w.stop_scheduler()


def reap_predecessor(conn: redis.Redis, pod: str, queues: list[str]) -> None:
    """Hand back what the pod's previous container left under the pod's name (see the module's doc)."""
    if not rq_registered(conn, [pod])[0]:
        return
    n = rqjobs.reap_worker(conn, pod, queues)
    log.warning("pod %s: the RQ worker of its previous container died without deregistering: "
                "%d job(s) it held handed back to RQ, its entry removed", pod, n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.rq.rq_worker", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
