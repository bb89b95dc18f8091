"""The ``fleet`` command's common parts: the one-line error and exit codes, the parser class,
the Redis client, output, and the argparse types shared by the commands."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import redis
from redis.exceptions import RedisClusterException

from stores.connection import ClusterModeError, NoFleetFound, connect_sync, ping, redact_url, resolve_url
from stores.roles import ADMIN, PasswordsFileError, as_role, password_env

if TYPE_CHECKING:
    from protocol.policy import KnownHandlers

EXIT_ERROR_REPLY = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3


class CliError(Exception):
    """A failure to report in one line, with its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """One-line errors. ``load``: a function that adds the options (and texts) on first use, so a
    subcommand's module is imported only when that subcommand is parsed or shows its help."""

    def __init__(self, *args: Any, load: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load = load

    def _loaded(self) -> None:
        if self._load is not None:
            load, self._load = self._load, None
            load(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._loaded()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._loaded()
        return super().format_usage()

    def format_help(self) -> str:
        self._loaded()
        return super().format_help()

    def error(self, message: str) -> NoReturn:  # one line, not the usage block
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see --help)\n")


def known_handlers() -> KnownHandlers:
    """The handlers that load here, and why each unavailable one does not (a policy check says it)."""
    from worker.handlers import known

    return known()


# The commands that submit turns and read replies connect as ``fleet-client``; ``fleet install``
# (FUNCTION LOAD, which no role may) as the admin; every other command (policies, rollouts,
# pins, dead letters, users, jobs, and the readers status, top, events) as ``fleet-operator``.
CLIENT_COMMANDS = frozenset({"submit", "chat", "cancel"})
ADMIN_COMMANDS = frozenset({"install"})


def command_role(command: str, create_tier: bool = False) -> str:
    """The ACL role ``fleet <command>`` connects as (``protocol.acl``; ``default``: the admin);
    ``--create-tier`` writes a policy, which only the operator may."""
    if command in ADMIN_COMMANDS:
        return ADMIN
    return "fleet-client" if command in CLIENT_COMMANDS and not create_tier else "fleet-operator"


def refused(exc: redis.RedisError, role: str) -> CliError | None:
    """One line for a refusal by Redis's ACL (``NOPERM``: a right the role lacks; ``WRONGPASS``:
    a wrong or unknown user), naming the role and the refused right; None for any other error."""
    if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in str(exc):
        return CliError(f"Redis refused the credentials of role {role} ({exc}): set "
                        f"${password_env(role)} to its password (`fleet acl --show-passwords`), or "
                        f"put that user's credentials in the URL", EXIT_USAGE)
    if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
        return CliError(f"Redis refused role {role}: {exc}; the ACL file `fleet acl` prints grants "
                        f"{role} what this command needs: load it, or use a user that has that right",
                        EXIT_USAGE)
    return None


def cli_client(args: argparse.Namespace) -> redis.Redis:
    """A client of Fleet's Redis as the role ``args.command`` needs (:func:`command_role`), when
    that role's password is known (``$FLEET_ACL_PASSWORD_<ROLE>`` or the passwords file)."""
    role = command_role(args.command, bool(getattr(args, "create_tier", False)))
    args.redis_role = role
    try:
        url = as_role(resolve_url(getattr(args, "redis_url", None)), role)
        # a cluster node's URL is asked at once, and redis-py's cluster client connects at once
        r = connect_sync(url, retries=2)
        ping(r)
    except NoFleetFound:
        raise  # the caller says where it looked
    except PasswordsFileError as exc:
        raise CliError(f"the roles' passwords file: {exc}", EXIT_USAGE) from None
    except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as exc:
        raise refused(exc, role) or CliError(str(exc)) from None
    except ClusterModeError as exc:  # FLEET_REDIS_CLUSTER: a bad value, or yes of a single node
        raise CliError(str(exc), EXIT_USAGE) from None
    except ValueError as exc:  # a URL redis-py cannot parse (main checks --redis-url and $REDIS_URL)
        raise CliError(f"bad Redis URL: {exc}", EXIT_USAGE) from None
    except (redis.ConnectionError, redis.TimeoutError, RedisClusterException, OSError) as exc:
        url = resolve_url(getattr(args, "redis_url", None))
        raise CliError(f"cannot reach Redis at {redact_url(url)}: {exc} (is the fleet up? `fleet up`)"
                       ) from None
    return r


def print_result(data: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=2, default=str) if as_json else text(data))


def json_object_arg(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} is not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(value, dict):
        raise CliError(f"{what} must be a JSON object, got {text[:40]!r}", EXIT_USAGE)
    return value




def count_arg(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def seconds_arg(minimum: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds, at least ``minimum``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not value >= minimum:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g} seconds, got {text}")
        return value
    return parse
