"""Fleet's RQ worker: an ``rq.SimpleWorker`` that runs only Fleet's registered jobs (issue 16).

``python -m worker.rq_worker --queues writeback[,eval] [--name N]`` (or ``fleet rq-worker``).

- *The allowlist.* RQ imports a job's function from the dotted path in the job's hash, so
  anyone who can write to Redis could make a plain ``rq worker`` run any importable function.
  Here a job's function must be ``worker.jobs.run`` (:class:`FleetJob` refuses any other: the
  job fails, with the reason in RQ's failed registry), which runs only a name registered in
  ``worker.jobs``; and jobs are JSON, never RQ's default serializer.
- *No fork per job* (``SimpleWorker``): the job runs in this process, so a SIGKILL of the
  worker ends its job too (no orphaned work-horse), and a job costs no fork.
- *Retiring*: SIGTERM is RQ's warm shutdown (the current job finishes, then the worker exits);
  a second SIGTERM is its cold shutdown.
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
import logging
import os
import sys
import uuid
from typing import Any

import redis
import setproctitle
from rq import SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

from stores import rqjobs
from stores.connection import connect_sync
from stores.registry import rq_registered
from worker import jobs

log = logging.getLogger("fleet.rq")
POD_NAME_ENV = "FLEET_WORKER_POD_NAME"  # the pod's name (Kubernetes' downward API), as a chat worker's
MAINTENANCE_INTERVAL_S = 30  # RQ's registry cleanup (RQ's default: 10 minutes)


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
    """RQ's in-process worker with Fleet's job class and serializer."""

    job_class = FleetJob


def build(conn: redis.Redis, queues: list[str], name: str | None = None) -> FleetWorker:
    """A worker on ``queues`` (Fleet's serializer, allowlist and maintenance interval)."""
    return FleetWorker(queues, name=name or f"rq-{uuid.uuid4().hex[:8]}", connection=conn,
                       job_class=FleetJob, serializer=JSONSerializer,
                       maintenance_interval=MAINTENANCE_INTERVAL_S)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--queues", required=True, help="comma-separated RQ queues to consume, in priority order")
    p.add_argument("--name", help=f"the worker's name in RQ's registry (default: the pod's name, "
                                  f"${POD_NAME_ENV}, in a pod; else random)")
    p.add_argument("--rq-url", help="RQ's Redis (default: $FLEET_RQ_URL, else $REDIS_URL)")
    p.add_argument("--burst", action="store_true", help="exit once the queues are empty")


def run(args: argparse.Namespace) -> int:
    """Work until SIGTERM (warm shutdown) or, with ``--burst``, until the queues are empty."""
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    if not queues:
        print("rq-worker: --queues names no queue", file=sys.stderr)
        return 2
    fleet_url = os.environ.get("REDIS_URL")
    url = args.rq_url or os.environ.get("FLEET_RQ_URL") or fleet_url
    if not url:
        print("rq-worker: no Redis: pass --rq-url or set REDIS_URL", file=sys.stderr)
        return 2
    if fleet_url and url != fleet_url:  # RQ on a node of its own: jobs read and write Fleet's
        jobs.use_fleet_redis(connect_sync(fleet_url))
    pod = None if args.name else os.environ.get(POD_NAME_ENV) or None
    name = args.name or pod
    setproctitle.setproctitle(f"fleet-rq-worker {','.join(queues)} {name or ''}".rstrip())
    conn = redis.Redis.from_url(url)
    if pod is not None:
        reap_predecessor(conn, pod, queues)
    w = build(conn, queues, name)
    w.work(burst=args.burst, with_scheduler=True, logging_level="INFO")
    return 0


def reap_predecessor(conn: redis.Redis, pod: str, queues: list[str]) -> None:
    """Hand back what the pod's previous container left under the pod's name (see the module's doc)."""
    if not rq_registered(conn, [pod])[0]:
        return
    n = rqjobs.reap_worker(conn, pod, queues)
    log.warning("pod %s: the RQ worker of its previous container died without deregistering: "
                "%d job(s) it held handed back to RQ, its entry removed", pod, n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.rq_worker", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
