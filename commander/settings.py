"""One settings object for the commander process (env ``FLEET_COMMANDER_*``, or the CLI flags derived
from it by ``protocol.flags``)."""

from __future__ import annotations

import os
import secrets
import socket
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from commander.group_runtimes import GroupRuntime, check_names
from protocol.ids import validate_token


class CommanderSettings(BaseSettings):
    """How the commander runs. How each tier scales is its policy, in Redis."""

    model_config = SettingsConfigDict(env_prefix="FLEET_COMMANDER_", frozen=True)
    # the command-line flags (protocol.flags); every other setting is tuning, environment only
    FLAGS: ClassVar[tuple[str, ...]] = (
        "redis_url", "rq_url", "commander_id", "log_level", "interval_s", "runtime", "spawn_mode",
        "log_dir", "metrics_host", "metrics_port", "stop_workers_on_exit", "max_total_workers",
        "k8s_namespace", "k8s_kubeconfig")

    redis_url: str | None = Field(None, description="default: $REDIS_URL, else the local fleet")
    rq_url: str | None = Field(None, description="RQ's Redis, one node (rq tiers' queues and RQ's "
                               "worker registry; default: $FLEET_RQ_URL, else Fleet's own, which "
                               "must then be one node)")
    commander_id: str = Field("", description="unique id (default: cmd-<host>-<random>)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    interval_s: float = Field(0.5, gt=0, le=60, description="seconds between passes",
                              json_schema_extra={"flag": "--interval"})
    lease_ttl_ms: int = Field(3000, ge=500, description="a dead leader is replaced after this")
    standby_poll_s: float = Field(1.0, gt=0, le=60, description="seconds between a standby's campaigns")
    always_tiers: tuple[str, ...] = Field(("chat",), description="tiers judged even with no policy key "
                                          "and no live worker: a fresh fleet's default tier gets its "
                                          "min_workers at once", json_schema_extra={"flag": None})
    spawn_mode: Literal["fork", "exec"] = Field(
        "fork", description="fork workers from a pre-imported template (fast) or exec them")
    log_dir: str = Field(".fleet/logs", description="worker logs")
    metrics_host: str = Field("127.0.0.1", description="bind address of /metrics")
    metrics_port: int | None = Field(9464, ge=0, le=65535, description="port of /metrics (0: any); "
                                     "None: no /metrics",
                                     json_schema_extra={"off_flag": ["--no-metrics", "serve no /metrics"]})
    worker_redis_url: str | None = Field(None, description="the Redis URL the workers this commander "
                                         "starts get (their ACL role's user; env only: a command "
                                         "line shows in ps); default: the commander's own URL",
                                         json_schema_extra={"flag": None})
    metrics_token: str | None = Field(None, description="the read token: a bearer token that reads "
                                      "/metrics, /healthz, the monitor page and its API, and writes "
                                      "nothing (env only: a command line shows in ps)",
                                      json_schema_extra={"flag": None})
    operator_token: str | None = Field(None, description="the operator token: reads as the read token "
                                       "does and may also retry and purge dead letters and requeue "
                                       "failed jobs from the monitor (env only). With neither token "
                                       "the monitor binds loopback only", json_schema_extra={"flag": None})
    allowed_hosts: tuple[str, ...] = Field((), description="host names a tokenless monitor also "
                                           "answers to, besides loopback's (a Host header check against "
                                           "DNS rebinding), and whose origins may post to it",
                                           json_schema_extra={"flag": None})
    stop_workers_on_exit: bool = Field(False, description="drain every worker when this commander exits "
                                       "(used by `fleet up`)")
    takeover_batch: int = Field(100, ge=1, le=10_000, description="pending entries of a dead worker "
                                "handed on per round trip")
    sweep_interval_s: float = Field(5.0, gt=0, le=3600, description="seconds between sweeps of the "
                                    "ready groups for consumers of dead workers")
    heartbeat_grace_s: float = Field(6.0, ge=0, le=3600, description="after an outage or a new "
                                     "leadership, a missing heartbeat counts as a dead worker only "
                                     "once Redis has been reachable this long (live workers beat "
                                     "again within their renew interval)")
    hung_after_s: float = Field(90.0, ge=1, le=86_400, description="a worker of ours whose process "
                                "runs but whose heartbeat has been missing this long (stopped, or "
                                "hung where its own watchdog, stuck_after_s, cannot end it) is killed "
                                "and replaced")
    max_total_workers: int = Field(64, ge=1, le=100_000, description="cap over every tier: a policy "
                                   "writer cannot make this host start more processes than this")
    runtime: Literal["process", "kubernetes"] = Field(
        "process", description="how workers start and stop: local processes, or one Deployment per "
        "tier whose replicas the commander writes (the Kubernetes guide; the k8s extra)")
    k8s_namespace: str | None = Field(None, description="kubernetes runtime: the namespace of the "
                                      "worker Deployments (default: the kubeconfig context's, else "
                                      "the commander pod's own, else default)")
    k8s_kubeconfig: str | None = Field(None, description="kubernetes runtime: a kubeconfig file "
                                       "(default: the commander pod's in-cluster config)")
    k8s_poll_s: float = Field(1.0, gt=0, le=60, description="kubernetes runtime: seconds between "
                              "listings of the worker pods and Deployments")
    # what a policy may run: the operator's allow-list, never a path or an image from Redis
    group_runtimes: dict[str, GroupRuntime] = Field(
        default_factory=dict, description="the runtimes a policy's group may name (`runtime`), as "
        "JSON: `{\"py312\": {\"python\": \"/opt/py312/bin/python\"}, \"gpu\": {\"image\": "
        "\"registry/x:1.2\"}}` (an interpreter for the process runtime, an image for the kubernetes "
        "one); a group naming another is rejected", json_schema_extra={"flag": None})

    @field_validator("group_runtimes")
    @classmethod
    def _runtime_names(cls, v: dict[str, GroupRuntime]) -> dict[str, GroupRuntime]:
        return check_names(v)

    def check_timeout_s(self) -> float:
        """How long a group interpreter's check may run: shorter than the leader lease."""
        return min(10.0, 0.8 * self.lease_ttl_ms / 1000)

    @model_validator(mode="after")
    def _id_and_timing(self) -> CommanderSettings:
        if not self.rq_url and os.environ.get("FLEET_RQ_URL"):  # the relay's and RQ workers' variable
            object.__setattr__(self, "rq_url", os.environ["FLEET_RQ_URL"])
        if not self.commander_id:
            host = "".join(c for c in socket.gethostname() if c.isalnum())[:20] or "host"
            object.__setattr__(self, "commander_id", f"cmd-{host}-{secrets.token_hex(3)}")
        validate_token(self.commander_id, "commander id")
        if self.runtime == "kubernetes" and self.stop_workers_on_exit:
            raise ValueError("stop_workers_on_exit does not apply to the kubernetes runtime: a "
                             "commander's exit there is a rollout or a failover, not the fleet's end "
                             "(scale the worker Deployments with kubectl)")
        if self.lease_ttl_ms < 2 * self.interval_s * 1000:
            raise ValueError("lease_ttl_ms must cover two passes, or a busy leader loses its lease")
        return self
