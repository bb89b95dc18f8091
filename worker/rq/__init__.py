"""Deferred jobs' side of the data plane: the relay that moves committed deferrals from users'
outboxes into RQ (``relay``, ``fleet relay``; its health check ``relay_health``), and Fleet's
RQ worker that runs them (``rq_worker``, ``fleet rq-worker``). RQ is the ``rq`` extra: only these
processes import it."""
