"""Security basics (docs/operations/security.md, proven): ACL users, TLS, passwords kept out of
argv and logs.

Every server here is a private redis-server that requires a password for its ``default``
(admin) user; Fleet's processes connect as the ``fleet`` user created with the exact
``ACL SETUSER`` line of the security page, so the documented privileges are the ones tested. The
TLS server loads the same line as an ACL file (``user …`` with a hashed password) and a
throwaway CA and server certificate made here with ``openssl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import redis

from fleet.client import AsyncFleet, Fleet
from protocol.models import WorkerInfo
from stores import functions
from tests.conftest import free_port
from tests.helpers import Processes, fleet_argv, live_workers, no_process_left
from tests.integration.conftest import FAST_WORKER_ENV, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECURITY_MD = ROOT / "docs" / "operations" / "security.md"
PACKAGES = ("protocol", "stores", "worker", "commander", "fleet")
ADMIN_PW = f"admin-{secrets.token_hex(12)}"
FLEET_PW = f"fleetpw-{secrets.token_hex(12)}"
OBSERVER_PW = f"observerpw-{secrets.token_hex(12)}"
SECRETS = (ADMIN_PW, FLEET_PW, OBSERVER_PW)
# redis-py announces itself with CLIENT SETINFO (Redis >= 7.2), ignoring a refusal
HARMLESS_DENIALS = {"client|setinfo"}


def fail_or_skip(reason: str) -> None:
    """A missing tool fails the run under CI and skips it elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def documented_rules(user: str) -> list[str]:
    """The rules of ``ACL SETUSER <user> …`` as the security page gives them (one line)."""
    prefix = f"ACL SETUSER {user} "
    lines = [ln.strip() for ln in SECURITY_MD.read_text().splitlines() if ln.strip().startswith(prefix)]
    assert len(lines) == 1, f"the security page must give exactly one `{prefix.strip()}` line"
    return shlex.split(lines[0])[3:]


def with_password(rules: list[str], password: str, hashed: bool = False) -> list[str]:
    """Replace the documented placeholder password (``>…``) with a real one."""
    secret = "#" + hashlib.sha256(password.encode()).hexdigest() if hashed else ">" + password
    out = [secret if rule.startswith(">") else rule for rule in rules]
    assert out != rules, "the documented ACL line sets no password"
    return out


# --- servers -------------------------------------------------------------------------------
@dataclass
class Certs:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


@dataclass
class SecureServer:
    """A redis-server with a password on ``default`` and, with ``certs``, TLS only."""

    workdir: Path
    certs: Certs | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def tls(self) -> bool:
        return self.certs is not None

    mutual: bool = False  # clients must present a certificate signed by the CA

    def url(self, user: str | None = "fleet", password: str | None = FLEET_PW, *,
            scheme: str | None = None, ca: bool = True, client_cert: bool | None = None) -> str:
        scheme = scheme or ("rediss" if self.tls else "redis")
        auth = f"{user or ''}:{password}@" if password else ""
        query = []
        if self.certs and scheme == "rediss":
            query += [f"ssl_ca_certs={self.certs.ca}"] if ca else []
            if self.mutual if client_cert is None else client_cert:
                query += [f"ssl_certfile={self.certs.client_cert}", f"ssl_keyfile={self.certs.client_key}"]
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0" + ("?" + "&".join(query) if query else "")

    def admin(self) -> redis.Redis:
        return redis.Redis.from_url(self.url("default", ADMIN_PW), socket_connect_timeout=1)

    def start(self, config: list[str]) -> None:
        """Start with ``config`` lines (a file of mode 0600: no secret on a command line)."""
        conf = self.workdir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(["bind 127.0.0.1", "save \"\"", "appendonly no",
                               f"dir {self.workdir}", f"logfile {self.workdir / 'redis.log'}",
                               *config]) + "\n")
        binary = shutil.which("redis-server")
        assert binary
        self.proc = subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        admin, deadline = self.admin(), time.monotonic() + 10
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self.log()[-1000:]}") from None
                time.sleep(0.02)
        functions.install(admin)  # as an admin would (`fleet install`)
        admin.close()

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        fail_or_skip(f"{tool} is not installed (apt-get install {tool})")
    return str(path)


def _openssl(*args: str) -> None:
    subprocess.run([_require("openssl"), *args], check=True, capture_output=True, timeout=30)


def _signed_cert(d: Path, name: str, ca: Path, ca_key: Path, san: str | None) -> tuple[Path, Path]:
    cert, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.cnf"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key),
             "-out", str(csr))
    ext.write_text(f"subjectAltName={san}\n" if san else "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client one (tmp dir, never committed)."""
    d = tmp_path_factory.mktemp("tls")
    ca, ca_key = d / "ca.pem", d / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=fleet-test-ca",
             "-keyout", str(ca_key), "-out", str(ca))
    cert, key = _signed_cert(d, "server", ca, ca_key, "IP:127.0.0.1,DNS:localhost")
    client_cert, client_key = _signed_cert(d, "client", ca, ca_key, None)
    return Certs(ca, cert, key, client_cert, client_key)


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureServer]:
    """Plain TCP; ``requirepass`` for the admin; users from the security page via ``ACL SETUSER``."""
    _require("redis-server")
    server = SecureServer(tmp_path_factory.mktemp("redis-acl"))
    server.start([f"port {server.port}", f"requirepass {ADMIN_PW}"])
    try:
        admin = server.admin()
        admin.execute_command("ACL", "SETUSER", "fleet", *with_password(documented_rules("fleet"), FLEET_PW))
        admin.execute_command("ACL", "SETUSER", "fleet-observer",
                              *with_password(documented_rules("fleet-observer"), OBSERVER_PW))
        admin.close()
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def _tls_server(workdir: Path, certs: Certs, mutual: bool) -> Iterator[SecureServer]:
    """TLS only (``port 0``); the users of the security page from an ACL file, passwords hashed."""
    _require("redis-server")
    aclfile = workdir / "users.acl"
    admin_hash = hashlib.sha256(ADMIN_PW.encode()).hexdigest()
    aclfile.write_text("\n".join([
        f"user default on #{admin_hash} ~* &* +@all",
        " ".join(["user fleet", *with_password(documented_rules("fleet"), FLEET_PW, hashed=True)]),
    ]) + "\n")
    aclfile.chmod(0o600)
    server = SecureServer(workdir, certs, mutual=mutual)
    try:
        try:
            server.start(["port 0", f"tls-port {server.port}", f"tls-cert-file {certs.cert}",
                          f"tls-key-file {certs.key}", f"tls-ca-cert-file {certs.ca}",
                          f"tls-auth-clients {'yes' if mutual else 'no'}", f"aclfile {aclfile}"])
        except RuntimeError as exc:
            if re.search(r"tls|ssl", str(exc), re.IGNORECASE) and "not" in str(exc).lower():
                pytest.skip(f"this redis-server build has no TLS support: {exc}")
            raise
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[SecureServer]:
    with _tls_server(tmp_path_factory.mktemp("redis-tls"), certs, mutual=False) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[SecureServer]:
    with _tls_server(tmp_path_factory.mktemp("redis-mtls"), certs, mutual=True) as server:
        yield server


# --- processes -----------------------------------------------------------------------------
@dataclass
class Procs:
    """The processes a test starts, each given the URL it connects with in its environment
    (never its argv); ``tests.helpers.Processes`` logs them and stops them by pid."""

    tmp: Path
    run: Processes = field(init=False)

    def __post_init__(self) -> None:
        self.run = Processes(self.tmp, grace_s=30, cwd=self.tmp)

    def env(self, url: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "FLEET_"))}
        env.update(FAST_WORKER_ENV)
        env.update(REDIS_URL=url, FLEET_HOME=str(self.tmp / "fleet-home"), PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)
        return env

    def start(self, name: str, argv: list[str], url: str, **extra: str) -> subprocess.Popen[bytes]:
        return self.run.start(name, argv, self.env(url, **extra)).proc

    def cli(self, url: str, *args: str) -> subprocess.Popen[str]:
        """``python -m fleet.cli …`` with ``REDIS_URL`` (not ``--redis-url``: argv is public)."""
        return subprocess.Popen(fleet_argv(*args), env=self.env(url), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=self.tmp)

    def logs(self) -> str:
        return self.run.logs()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.run.stop_all()


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run_all(*popens: subprocess.Popen[str]) -> list[tuple[int, str, str]]:
    """Wait for CLI processes started together (they run in parallel: the suite stays fast)."""
    return [finish(p) for p in popens]


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"a password leaked into {where}"


def assert_clean_failure(result: tuple[int, str, str], expect: str) -> None:
    """Non-zero exit, one line on stderr naming the problem, no password anywhere."""
    code, out, err = result
    assert code != 0, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(expect, err, re.IGNORECASE), err
    assert_no_secret(out + err, "a CLI error")


def denials(admin: redis.Redis) -> list[dict]:
    """ACL LOG entries other than harmless ones: a command the documented user lacks."""
    return [e for e in admin.acl_log() if e.get("object") not in HARMLESS_DENIALS]


def wait_worker(admin: redis.Redis, proc: subprocess.Popen[bytes], procs: Procs) -> WorkerInfo:
    wait_until(lambda: live_workers(admin) or proc.poll() is not None, 30, "a worker to register")
    assert proc.poll() is None, procs.logs()[-3000:]
    return live_workers(admin)[0]


def stop_commander(proc: subprocess.Popen[bytes], worker_pid: int) -> None:
    """SIGTERM: it drains the workers it started; none may be left behind."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=40)
    no_process_left([worker_pid], within_s=10)


def assert_url_only_in_env(pid: int, url: str) -> None:
    """The password reaches a process through its environment, never its argv: ``ps`` shows
    argv to every user, while ``/proc/<pid>/environ`` (``ps e``) is readable by the process's
    own user alone (mode 0400), who can read the commander's environment and the passwords file
    anyway. (A worker's environment stays intact: the commander reads its spawn proof there.)"""
    proc = psutil.Process(pid)
    assert_no_secret(" ".join(proc.cmdline()), f"the command line of pid {pid}")
    mode = stat.S_IMODE(os.stat(f"/proc/{pid}/environ").st_mode)
    assert mode == 0o400, f"pid {pid}'s environment is readable by others ({mode:o})"


def submit_sync(url: str, user: str, text: str) -> str:
    with Fleet(url) as fleet:
        reply = fleet.submit(user, text).result(timeout=20)
    assert reply.ok, reply.error
    return reply.text


def submit_async(url: str, user: str, text: str) -> str:
    async def ask() -> str:
        fleet = AsyncFleet(url)
        try:
            reply = await fleet.ask(user, text, timeout=20)
        finally:
            await fleet.aclose()
        assert reply.ok, reply.error
        return reply.text

    return asyncio.run(ask())


def _clean_admin(server: SecureServer) -> Iterator[redis.Redis]:
    """The admin's client of ``server``, its data and ACL log emptied; closed after the test."""
    admin = server.admin()
    admin.flushall()
    admin.acl_log_reset()
    yield admin
    admin.close()


@pytest.fixture
def admin_acl(acl_server: SecureServer) -> Iterator[redis.Redis]:
    yield from _clean_admin(acl_server)


@pytest.fixture
def admin_tls(tls_server: SecureServer) -> Iterator[redis.Redis]:
    yield from _clean_admin(tls_server)


# --- (a) the ACL user end to end ------------------------------------------------------------
def test_acl_user_serves_worker_python_client_cli_and_observer(
        acl_server: SecureServer, admin_acl: redis.Redis, procs: Procs) -> None:
    url = acl_server.url()
    worker = procs.start("worker", ["-m", "worker", "--tier", "chat", "--worker-id", "chat-sec1"], url)
    wait_worker(admin_acl, worker, procs)
    assert "hello" in submit_sync(url, "alice", "hello")
    assert "async hello" in submit_async(url, "bob", "async hello")
    submit, policy = procs.cli(url, "submit", "--user", "carol", "from the cli"), \
        procs.cli(url, "policy", "set", "chat", "concurrency=4")
    (code, out, err), (pcode, _, perr) = run_all(submit, policy)
    assert code == 0 and "from the cli" in out, err
    assert pcode == 0, perr

    observer = acl_server.url("fleet-observer", OBSERVER_PW)
    views = run_all(*(procs.cli(observer, *args) for args in (
        ["status"], ["top", "--once"], ["events"], ["dead-letters"], ["policy", "get", "chat"])))
    for code, _, err in views:
        assert code == 0, err
    assert denials(admin_acl) == [], "the documented ACL lacks a command Fleet uses"

    refused = finish(procs.cli(observer, "submit", "--user", "dave", "may I?"))
    assert_clean_failure(refused, r"no permissions|NOPERM")
    assert_url_only_in_env(worker.pid, url)
    assert_no_secret(procs.logs(), "a log")


def test_commander_spawns_its_worker_and_metrics_need_the_token(
        acl_server: SecureServer, admin_acl: redis.Redis, procs: Procs) -> None:
    url, port, token = acl_server.url(), free_port(), secrets.token_hex(16)
    env = procs.env(url, FLEET_COMMANDER_METRICS_TOKEN=token)
    commander = procs.run.commander(env, "sec1", "--spawn-mode", "exec", "--metrics-port", str(port),
                                    metrics=True).proc
    info = wait_worker(admin_acl, commander, procs)
    code, out, err = finish(procs.cli(url, "submit", "--user", "erin", "via the commander's worker"))
    assert code == 0 and "via the commander's worker" in out, err

    # (d) /metrics: loopback only by default, and 401 without the bearer token
    listening = [c.laddr for c in psutil.Process(commander.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [a.ip for a in listening] == ["127.0.0.1"]
    endpoint = f"http://127.0.0.1:{port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(endpoint, timeout=5)
    denied.value.close()
    assert denied.value.code == 401
    request = urllib.request.Request(endpoint, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 200 and b"fleet_" in resp.read()

    assert_url_only_in_env(commander.pid, url)
    assert_url_only_in_env(info.pid, url)
    assert denials(admin_acl) == [], "the documented ACL lacks a command Fleet uses"
    stop_commander(commander, info.pid)
    assert_no_secret(procs.logs(), "a log")


# --- (b) wrong or missing credentials --------------------------------------------------------
def test_wrong_or_missing_password_is_a_one_line_error_without_the_password(
        acl_server: SecureServer, procs: Procs) -> None:
    wrong, nobody = acl_server.url("fleet", OBSERVER_PW), acl_server.url(None, None)
    unknown = acl_server.url("intruder", FLEET_PW)
    results = run_all(*(procs.cli(u, "submit", "--user", "alice", "hi") for u in (wrong, nobody, unknown)))
    assert_clean_failure(results[0], r"invalid username-password")
    assert_clean_failure(results[1], r"auth")
    assert_clean_failure(results[2], r"invalid username-password")
    with pytest.raises(redis.AuthenticationError), Fleet(wrong) as fleet:
        fleet.submit("alice", "hi")


# --- (c) TLS -----------------------------------------------------------------------------------
def test_tls_end_to_end_with_the_ca_in_the_url(
        tls_server: SecureServer, admin_tls: redis.Redis, procs: Procs) -> None:
    url = tls_server.url()
    assert url.startswith("rediss://fleet:") and "?ssl_ca_certs=" in url
    # fork mode: the URL reaches the worker through the template's request, not a command line
    commander = procs.run.commander(procs.env(url), "sec1", "--spawn-mode", "fork").proc
    info = wait_worker(admin_tls, commander, procs)
    code, out, err = finish(procs.cli(url, "submit", "--user", "frank", "over tls"))
    assert code == 0 and "over tls" in out, err
    assert "sync tls" in submit_sync(url, "grace", "sync tls")
    assert "async tls" in submit_async(url, "heidi", "async tls")
    assert_url_only_in_env(info.pid, url)
    assert denials(admin_tls) == [], "the documented ACL lacks a command Fleet uses"
    stop_commander(commander, info.pid)
    assert_no_secret(procs.logs(), "a log")


def test_tls_port_refuses_plain_and_unverified_clients_cleanly(tls_server: SecureServer,
                                                               procs: Procs) -> None:
    plain = tls_server.url(scheme="redis")
    no_ca = tls_server.url(ca=False)
    results = run_all(*(procs.cli(u, "submit", "--user", "alice", "hi") for u in (plain, no_ca)))
    assert_clean_failure(results[0], r"cannot reach Redis")
    assert_clean_failure(results[1], r"certificate verify failed")


def test_mutual_tls_client_certificate_in_the_url(mtls_server: SecureServer, procs: Procs) -> None:
    url, without = mtls_server.url(), mtls_server.url(client_cert=False)
    assert "ssl_certfile=" in url and "ssl_keyfile=" in url
    ok, refused = run_all(procs.cli(url, "status"), procs.cli(without, "status"))
    assert ok[0] == 0, ok[2]
    # TLS 1.3: the server's "certificate required" alert may race the client's first write
    assert_clean_failure(refused, r"cannot reach Redis.*(certificate required|EOF occurred|reset by peer)")


# --- (e) nothing a Redis writer sends is executed --------------------------------------------
def test_no_pickle_in_the_package() -> None:
    """Every message is msgpack or JSON; unpickling would run a Redis writer's code."""
    offenders = [f"{path.relative_to(ROOT)}:{n}"
                 for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"\b(c?pickle|marshal|shelve|dill)\b", line)]
    assert offenders == []


def test_security_md_names_what_the_tests_prove() -> None:
    text = SECURITY_MD.read_text()
    for needle in ("ACL SETUSER fleet ", "ACL SETUSER fleet-observer ", "rediss://", "ssl_ca_certs",
                   "FLEET_COMMANDER_METRICS_TOKEN", "127.0.0.1", "tests/unit/test_policy.py"):
        assert needle in text, needle
