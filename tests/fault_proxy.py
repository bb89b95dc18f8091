"""A TCP proxy in front of a redis-server that answers an error of the test's choosing to some
commands (``LOADING``, ``MASTERDOWN``, ...: states a test cannot easily put a real server in).

Each client connection gets a thread that reads one command (a RESP array of bulk strings, as
redis-py sends them), and either answers ``fault`` itself, when one is set and the command is
among ``commands`` (empty: every command), or forwards it and relays the server's one reply
(RESP2 or RESP3).
One command at a time per connection keeps the replies in order whatever is injected.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable


class _Stream:
    """Buffered reads of whole RESP lines and blocks from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        self.buf += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line + b"\r\n"

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def value(self) -> bytes:
        """One whole RESP2 or RESP3 value, raw."""
        line = self.line()
        kind, body = line[:1], line[1:-2]
        if kind in (b"$", b"=", b"!"):  # blobs
            return line + (self.exactly(int(body) + 2) if int(body) >= 0 else b"")
        if kind in (b"*", b"~", b">", b"%", b"|"):  # aggregates (a map's and attribute's: pairs)
            n = max(0, int(body)) * (2 if kind in (b"%", b"|") else 1)
            out = line + b"".join(self.value() for _ in range(n))
            return out + self.value() if kind == b"|" else out  # an attribute precedes its value
        return line  # + - : _ , # (


def _name(command: bytes) -> str:
    """The command's name (its first argument), upper case."""
    lines = command.split(b"\r\n")
    return lines[2].decode(errors="replace").upper() if len(lines) > 2 else ""


class FaultProxy:
    """Listens on a free loopback port; ``url`` is what the processes under test connect to."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.fault: str | None = None  # e.g. "LOADING Redis is loading the dataset in memory"
        self.commands: frozenset[str] = frozenset()
        self.injected = 0  # errors answered so far
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, user: str = "") -> str:
        return f"redis://{user + '@' if user else ''}127.0.0.1:{self.port}/0"

    def inject(self, fault: str | None, commands: Iterable[str] = ()) -> None:
        """Answer ``-<fault>`` to ``commands`` (every command if none), from now on; None: stop."""
        with self._lock:
            self.commands = frozenset(c.upper() for c in commands)
            self.fault = fault

    def _faulty(self, command: bytes) -> str | None:
        with self._lock:
            if self.fault is not None and (not self.commands or _name(command) in self.commands):
                self.injected += 1
                return self.fault
            return None

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        with self._lock:
            self._open += [client, upstream]
        src, dst = _Stream(client), _Stream(upstream)
        try:
            while True:
                command = src.value()
                fault = self._faulty(command)
                if fault is not None:
                    client.sendall(b"-" + fault.encode() + b"\r\n")
                    continue
                upstream.sendall(command)
                client.sendall(dst.value())
        except OSError:
            pass  # either side closed: close the other
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._open:
                sock.close()
