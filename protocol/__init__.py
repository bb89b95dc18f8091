"""Fleet's wire contract: message models, the msgpack codec and every Redis key name."""

from protocol.codec import PROTOCOL_VERSION, CodecError, decode, encode
from protocol.ids import InvalidId, validate_tier, validate_user_id
from protocol.models import (
    Control,
    Counters,
    HandlerResult,
    MemoryItem,
    OccupancyReport,
    Reply,
    SessionEntry,
    Slots,
    Turn,
)
from protocol.policy import Policy, PolicyError, RqPolicy, TurnsPolicy, parse_policy

__all__ = [
    "PROTOCOL_VERSION",
    "CodecError",
    "Control",
    "Counters",
    "HandlerResult",
    "InvalidId",
    "MemoryItem",
    "OccupancyReport",
    "Policy",
    "PolicyError",
    "Reply",
    "RqPolicy",
    "SessionEntry",
    "Slots",
    "Turn",
    "TurnsPolicy",
    "decode",
    "encode",
    "parse_policy",
    "validate_tier",
    "validate_user_id",
]
