"""The listening socket of every `k3` server (`k3 serve`, `k3 atlas serve|demo`, `k3 sandbox serve`): bound
before the slow part (loading a model, scanning a checkpoint), so a bad or taken port is a one-line error at
once; the URL printed is the address actually bound.

    sock = listening_socket("127.0.0.1", 8000)             # K3Error if 8000 is taken or not a port
    sock = listening_socket("127.0.0.1", 8000, tries=20)   # 8000, else 8001 ... 8019, else any free port
    print(url_of(sock)); run_app(app, sock, "warning")
"""

from __future__ import annotations

import errno
import socket

from k3.errors import K3Error


class ListenError(K3Error):
    """A port that is not one, is taken, or may not be bound here."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int, tries: int = 1) -> socket.socket:
    """A socket listening on host:port. `tries` > 1: the next ports up to port + tries - 1 when it is taken,
    then any free port (the caller prints `url_of`, the one bound)."""
    if not 0 <= port <= 65535:
        raise ListenError(f"--port {port}: a port is a number in 0..65535 (0: any free one)")
    candidates = [port + i for i in range(tries) if port + i <= 65535] + ([0] if tries > 1 else [])
    for candidate in candidates:
        try:
            return _bind(host, candidate)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise ListenError(f"cannot listen on {host}:{candidate}: {e.strerror or e}") from None
    raise ListenError(
        f"port {port} on {host} is taken (another server is listening there): "
        "choose another with --port, or --port 0 for any free one"
    )


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def run_app(app, sock: socket.socket, log_level: str) -> None:
    """Serve the ASGI `app` on `sock` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
