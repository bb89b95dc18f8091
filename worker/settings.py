"""One settings object per worker process (env ``FLEET_WORKER_*`` or CLI flags)."""

from __future__ import annotations

import os
import secrets

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.ids import validate_tier, validate_token


class WorkerSettings(BaseSettings):
    """How a worker runs. What a *tier* runs (handler, concurrency) comes from its policy."""

    model_config = SettingsConfigDict(env_prefix="FLEET_WORKER_", frozen=True)

    redis_url: str | None = Field(None, description="default: REDIS_URL, else the local fleet")
    tier: str = "chat"
    worker_id: str = ""
    batch: int = Field(32, ge=1, le=1000)
    block_ms: int = Field(1000, ge=10, le=60_000)
    lane_ttl_ms: int = Field(6000, ge=500)
    renew_interval_s: float = Field(1.5, gt=0)
    reclaim_idle_ms: int = Field(6000, ge=100, description="pending this long = its owner is gone")
    reclaim_interval_s: float = Field(1.0, gt=0)
    housekeeping_interval_s: float = Field(10.0, gt=0)
    policy_refresh_s: float = Field(2.0, gt=0)
    handler_rescan_s: float = Field(30.0, gt=0, description="a policy names a handler this worker "
                                    "lacks: look for newly installed ones (entry points) this often")
    heartbeat_ttl_ms: int = Field(5000, ge=500)
    max_turn_bytes: int = Field(64 * 1024, ge=256)
    max_reply_bytes: int = Field(256 * 1024, ge=256)
    handler_timeout_s: float = Field(300.0, gt=0)
    session_max: int = Field(200, ge=1)
    context_turns: int = Field(20, ge=0)
    memory_k: int = Field(5, ge=0)
    reply_ttl_s: int = Field(3600, ge=1)
    handler_trace: str | None = Field(
        None, description="append a JSON line per handler entry and exit here (exclusivity checks)")

    @field_validator("tier")
    @classmethod
    def _tier(cls, v: str) -> str:
        return validate_tier(v)

    @model_validator(mode="after")
    def _ids_and_timing(self) -> WorkerSettings:
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.tier}-{secrets.token_hex(4)}")
        validate_token(self.worker_id, "worker id")
        if self.reclaim_idle_ms <= self.renew_interval_s * 1000 * 2:
            raise ValueError("reclaim_idle_ms must exceed two renew intervals, or live owners get robbed")
        if self.lane_ttl_ms <= self.renew_interval_s * 1000 * 2:
            raise ValueError("lane_ttl_ms must exceed two renew intervals")
        return self

    @property
    def host(self) -> str:
        return os.uname().nodename
