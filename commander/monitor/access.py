"""Who may use the monitor: its tokens, the host names it answers to, the addresses it may bind.

No web framework here: the commander checks a bind before it serves (``refusal``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from commander.settings import CommanderSettings

COOKIE = "fleet_monitor"
LOOPBACK_NAMES = {"localhost"}
Grant = Literal["none", "read", "write"]


@dataclass(frozen=True)
class Access:
    """The tokens and the host names the server accepts (none: loopback, open, Host-checked)."""

    read_token: str | None = None
    operator_token: str | None = None
    allowed_hosts: tuple[str, ...] = ()

    @property
    def guarded(self) -> bool:
        return bool(self.read_token or self.operator_token)

    def tokens(self) -> list[tuple[str, Grant]]:
        """Each token with what it grants, the operator's first."""
        pairs: list[tuple[str | None, Grant]] = [(self.operator_token, "write"), (self.read_token, "read")]
        return [(t, g) for t, g in pairs if t]

    def allows(self, name: str) -> bool:
        """Whether ``name`` (a host name, lowercased) is one of the allowed hosts."""
        return name in {h.lower() for h in self.allowed_hosts}

    def host_allowed(self, host: str) -> bool:
        """Whether a ``Host`` value names this server: a loopback name or address, or an allowed host."""
        name = hostname(host)
        return name in LOOPBACK_NAMES or _is_loopback_ip(name) or self.allows(name)


def access_of(settings: CommanderSettings) -> Access:
    """The commander's settings' tokens (an empty one: none) and allowed hosts."""
    return Access(read_token=settings.metrics_token or None, operator_token=settings.operator_token or None,
                  allowed_hosts=settings.allowed_hosts)


def hostname(host: str) -> str:
    """The name of a ``Host`` value, without the port and the IPv6 brackets, lowercased."""
    try:
        return (urlsplit(f"//{host}").hostname or "").lower()
    except ValueError:  # an unclosed IPv6 bracket
        return ""


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback only (``""``, ``0.0.0.0`` and ``::`` are every interface)."""
    return host.lower() in LOOPBACK_NAMES or _is_loopback_ip(host)


def refusal(host: str, access: Access) -> str | None:
    """Why the server must not bind ``host`` with ``access``; None when it may."""
    if is_loopback(host) or access.guarded:
        return None
    return (f"refusing to serve the monitor and /metrics on {host} without a token: set "
            "FLEET_COMMANDER_OPERATOR_TOKEN (and FLEET_COMMANDER_METRICS_TOKEN for read-only viewers "
            "and scrapers), or bind 127.0.0.1")


def cookie_value(token: str) -> str:
    """The session cookie for ``token``: a keyed hash, so the cookie never carries the token."""
    return hmac.new(token.encode(), b"fleet-monitor-cookie", hashlib.sha256).hexdigest()


def grant(header: str | None, cookie: str | None, access: Access) -> Grant:
    """What a request's credentials grant: everything without a token, else the matching token's."""
    if not access.guarded:
        return "write"
    for token, granted in access.tokens():
        if header is not None and hmac.compare_digest(header.strip().encode(), f"Bearer {token}".encode()):
            return granted
        if cookie is not None and hmac.compare_digest(cookie.encode(), cookie_value(token).encode()):
            return granted
    return "none"
