"""The server's listening sockets, bound before anything slow happens.

`loraplex serve` binds its port (and `--metrics-port`) right after parsing its command line, before it
imports torch, loads the model or starts the engine process: a port that is already taken ends the command
within a second, exit code 1, with one line on stderr

    loraplex: cannot listen on 127.0.0.1:8000: address already in use

(any other bind failure: the OS's reason, e.g. `permission denied`, `cannot assign requested address`).
The bound sockets are handed to uvicorn, which starts listening on them once the engine is loaded (the same
moment as before: until then a connection is refused rather than left waiting). The sockets are bound as
uvicorn's own `loop.create_server(host=..., port=...)` binds them: one socket per address `--host` resolves
to (`localhost`: 127.0.0.1 and ::1), `SO_REUSEADDR` (a restart is not blocked by TIME_WAIT connections),
`IPV6_V6ONLY` on IPv6 sockets, not inherited by child processes. Port 0 binds a free port (the banner names it).

Two servers started at the same moment on one port can both bind (`SO_REUSEADDR`, nobody listens yet); the
second then fails when it starts listening, after its model loaded, with the same line and exit code 1
(`GatewayServer.startup`).
"""
from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass, field


class ListenError(Exception):
    """A port this server cannot listen on; `str()` is the whole one-line message (no `loraplex:` prefix)."""


def address_label(host: str, port: int) -> str:
    """`HOST:PORT` as a URL writes it (`[::1]:8000` for an IPv6 address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def os_reason(exc: OSError) -> str:
    """`address already in use`: the OS's wording of the error, lower case, without `[Errno 98]`."""
    text = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    return text.lower()


def cannot_listen(host: str, port: int, exc: OSError) -> ListenError:
    return ListenError(f"cannot listen on {address_label(host, port)}: {os_reason(exc)}")


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Binds (without listening) every address `host` resolves to, as asyncio's `create_server` would
    (`SO_REUSEADDR`, `IPV6_V6ONLY`); an address family the host cannot use (`EADDRNOTAVAIL`) is skipped while
    another address binds. Raises `ListenError` naming HOST:PORT and the reason."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise cannot_listen(host, port, exc) from None
    sockets: list[socket.socket] = []
    unavailable: OSError | None = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):   # de-duplicated, in resolver order
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:   # a family this host cannot create (as asyncio: skipped)
                continue
            sockets.append(sock)
            sock.set_inheritable(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:   # e.g. ::1 without IPv6: skipped if another address binds
                    sockets.pop().close()
                    unavailable = unavailable or exc
                    continue
                raise cannot_listen(host, port, exc) from None
        if not sockets:
            raise cannot_listen(host, port, unavailable or OSError(errno.EADDRNOTAVAIL, "no address to bind"))
    except BaseException:
        close_all(sockets)
        raise
    return sockets


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


@dataclass
class BoundPorts:
    """The API port's sockets and `--metrics-port`'s (empty without it), bound and not yet listening."""

    host: str
    api: list[socket.socket]
    metrics: list[socket.socket] = field(default_factory=list)

    @property
    def port(self) -> int:
        """The API port (the one port 0 was given)."""
        return int(self.api[0].getsockname()[1])

    @property
    def metrics_port(self) -> int | None:
        return int(self.metrics[0].getsockname()[1]) if self.metrics else None

    def close(self) -> None:
        """Closes what uvicorn has not taken over (closing twice is harmless)."""
        close_all(self.api)
        close_all(self.metrics)


def bind_ports(host: str, port: int, metrics_port: int | None = None) -> BoundPorts:
    """The API port, then `--metrics-port`; raises `ListenError` (nothing left bound) if either fails."""
    api = bind_tcp(host, port)
    try:
        metrics = bind_tcp(host, metrics_port) if metrics_port is not None else []
    except BaseException:
        close_all(api)
        raise
    return BoundPorts(host, api, metrics)
