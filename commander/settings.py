"""One settings object for the commander process (env ``FLEET_COMMANDER_*`` or CLI flags)."""

from __future__ import annotations

import secrets
import socket
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.ids import validate_token


class CommanderSettings(BaseSettings):
    """How the commander runs. How each tier scales is its policy, in Redis."""

    model_config = SettingsConfigDict(env_prefix="FLEET_COMMANDER_", frozen=True)

    redis_url: str | None = None
    commander_id: str = ""
    interval_s: float = Field(0.5, gt=0, le=60, description="seconds between passes")
    lease_ttl_ms: int = Field(3000, ge=500, description="a dead leader is replaced after this")
    standby_poll_s: float = Field(1.0, gt=0, le=60)
    always_tiers: tuple[str, ...] = ("chat",)
    spawn_mode: Literal["fork", "exec"] = "fork"
    log_dir: str = ".fleet/logs"
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(9464, ge=0, le=65535, description="None: no /metrics")
    metrics_token: str | None = None
    stop_workers_on_exit: bool = False
    takeover_batch: int = Field(100, ge=1, le=10_000, description="pending entries of a dead worker "
                                "handed on per round trip")
    sweep_interval_s: float = Field(5.0, gt=0, le=3600, description="seconds between sweeps of the "
                                    "ready groups for consumers of dead workers")
    heartbeat_grace_s: float = Field(6.0, ge=0, le=3600, description="after an outage or a new "
                                     "leadership, a missing heartbeat counts as a dead worker only "
                                     "once Redis has been reachable this long (live workers beat "
                                     "again within their renew interval)")
    max_total_workers: int = Field(64, ge=1, le=100_000, description="cap over every tier: a policy "
                                   "writer cannot make this host start more processes than this")

    @model_validator(mode="after")
    def _id_and_timing(self) -> CommanderSettings:
        if not self.commander_id:
            host = "".join(c for c in socket.gethostname() if c.isalnum())[:20] or "host"
            object.__setattr__(self, "commander_id", f"cmd-{host}-{secrets.token_hex(3)}")
        validate_token(self.commander_id, "commander id")
        if self.lease_ttl_ms < 2 * self.interval_s * 1000:
            raise ValueError("lease_ttl_ms must cover two passes, or a busy leader loses its lease")
        return self
