"""Whether a client talks to a Redis Cluster: the stores that must act differently there
(ordered submit, no multi-slot transactions, no scripts in pipelines) ask here."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis


def is_cluster(r: Any) -> bool:
    """True for redis-py's ``RedisCluster`` (blocking or asyncio), and for a pipeline of one."""
    return isinstance(r, (redis.RedisCluster, aioredis.RedisCluster,
                          redis.cluster.ClusterPipeline, aioredis.cluster.ClusterPipeline))
