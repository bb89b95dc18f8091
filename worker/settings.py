"""One settings object per worker process (env ``FLEET_WORKER_*``, or the CLI flags derived from it
by ``protocol.flags``)."""

from __future__ import annotations

import os
import secrets
from typing import ClassVar, Literal, TypedDict

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.groups import pool_name, validate_group
from protocol.ids import validate_tier, validate_token
from protocol.models import RENEW_INTERVAL_S


class Placement(TypedDict, total=False):
    """Where a worker runs, as its registry entry (``WorkerInfo``) says beyond ``host``."""

    runtime: str
    pod: str | None
    node: str | None


class WorkerSettings(BaseSettings):
    """How a worker runs. What a *tier* runs (handler, concurrency) comes from its policy."""

    model_config = SettingsConfigDict(env_prefix="FLEET_WORKER_", frozen=True)
    # the command-line flags (protocol.flags); every other setting is tuning, environment only
    FLAGS: ClassVar[tuple[str, ...]] = ("redis_url", "tier", "group", "worker_id", "log_level",
                                        "health_port")

    redis_url: str | None = Field(None, description="default: $REDIS_URL, else the local fleet")
    tier: str = Field("chat", description="tier to serve")
    group: str = Field("", description="the group of the tier to serve (its pool <tier>.<group>); "
                       "empty: the tier's own pool")
    worker_id: str = Field("", description="unique id (default: <tier>-<random hex>)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field(
        "auto", description="the event loop: auto = uvloop if installed (+37% turns/s in "
                            "scripts/bench_peers, docs/BENCHMARKS.md), else asyncio's")
    batch: int = Field(32, ge=1, le=1000, description="notifications read at most per XREADGROUP")
    block_ms: int = Field(1000, ge=10, le=60_000, description="how long a read of the ready stream blocks")
    lane_ttl_ms: int = Field(6000, ge=500, description="a lane expires this long after its renewal")
    renew_interval_s: float = Field(RENEW_INTERVAL_S, gt=0,
                                    description="seconds between renewals of lanes, heartbeat")
    reclaim_idle_ms: int = Field(6000, ge=100, description="pending this long = its owner is gone")
    reclaim_interval_s: float = Field(1.0, gt=0, description="seconds between reclaims of idle notifications")
    housekeeping_interval_s: float = Field(10.0, gt=0, description="seconds between stream trims")
    policy_refresh_s: float = Field(2.0, gt=0, description="seconds between reads of the tier's policy")
    handler_rescan_s: float = Field(30.0, gt=0, description="a policy names a handler this worker "
                                    "lacks: look for newly installed ones (entry points) this often")
    heartbeat_ttl_ms: int = Field(5000, ge=500, description="the heartbeat key's TTL")
    stuck_after_s: float = Field(30.0, ge=1, description="the worker exits (code 70) when its event "
                                 "loop has not turned this long (a blocking call in an async "
                                 "handler): its heartbeat stops, the commander replaces it")
    max_turn_bytes: int = Field(64 * 1024, ge=256, description="a larger encoded turn is dead-lettered")
    max_reply_bytes: int = Field(256 * 1024, ge=256, description="a larger reply is a handler failure")
    handler_timeout_s: float = Field(300.0, gt=0, description="an async handler running longer fails")
    session_max: int = Field(200, ge=1, description="turns kept in a user's session")
    context_turns: int = Field(20, ge=0, description="the newest session turns given to the handler")
    memory_k: int = Field(5, ge=0, description="memories given to the handler")
    reply_ttl_s: int = Field(3600, ge=1, description="seconds a reply (and a streamed turn's reply "
                             "stream) waits for its reader")
    stream_flush_ms: int = Field(20, ge=0, le=10_000, description="a streamed turn's emitted text is "
                                 "first written to its reply stream this soon (every turn's in one round "
                                 "trip); each next write waits twice as long as the last")
    stream_flush_max_ms: int = Field(100, ge=0, le=10_000, description="the longest wait between two "
                                     "writes of a streamed turn's text (at least stream_flush_ms)")
    handler_trace: str | None = Field(
        None, description="append a JSON line per handler entry and exit here (exclusivity checks)")
    # Kubernetes (the downward API: metadata.name, spec.nodeName); see docs/guide/kubernetes.md
    pod_name: str | None = Field(None, description="the pod this worker runs in: its default worker "
                                 "id, registered with runtime=kubernetes")
    node_name: str | None = Field(None, description="the node of its pod: registered as its host")
    health_port: int | None = Field(None, ge=0, le=65535, description="serve /readyz and /livez on "
                                    "this port (0: any); None: no health endpoint")
    health_host: str = Field("0.0.0.0", description="bind address of the health endpoint (the kubelet "
                             "probes the pod's IP)")
    drain_linger_s: float = Field(30.0, ge=0, le=3600, description="in a pod, a worker drained by "
                                  "command waits this long for its SIGTERM before it exits, so the "
                                  "kubelet does not restart the container its ReplicaSet is deleting")

    @field_validator("tier")
    @classmethod
    def _tier(cls, v: str) -> str:
        return validate_tier(v)

    @field_validator("group")
    @classmethod
    def _group(cls, v: str) -> str:
        return validate_group(v) if v else v

    @model_validator(mode="after")
    def _ids_and_timing(self) -> WorkerSettings:
        if not self.worker_id:
            object.__setattr__(self, "worker_id", self.pod_name or
                               f"{self.pool}-{secrets.token_hex(4)}")
        validate_token(self.worker_id, "worker id")
        if self.reclaim_idle_ms <= self.renew_interval_s * 1000 * 2:
            raise ValueError("reclaim_idle_ms must exceed two renew intervals, or live owners get robbed")
        if self.lane_ttl_ms <= self.renew_interval_s * 1000 * 2:
            raise ValueError("lane_ttl_ms must exceed two renew intervals")
        if self.stuck_after_s <= self.renew_interval_s * 2:
            raise ValueError("stuck_after_s must exceed two renew intervals")
        return self

    @property
    def pool(self) -> str:
        """Whose ready streams, registry entry and reports: the tier's, or its group's
        ``<tier>.<group>`` (``protocol.groups``)."""
        return pool_name(self.tier, self.group)

    @property
    def host(self) -> str:
        """The machine it runs on: its pod's node in Kubernetes, else this host's name."""
        return self.node_name or os.uname().nodename

    @property
    def placement(self) -> Placement:
        """The registry fields that say where it runs, beyond ``host``: none for a process."""
        if not self.pod_name:
            return {}
        return {"runtime": "kubernetes", "pod": self.pod_name, "node": self.node_name}
