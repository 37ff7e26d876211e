"""The listening socket of every `k3` server (`k3 serve`, `k3 atlas serve|demo`, `k3 sandbox serve`): bound
before the slow part (loading a model, scanning a checkpoint), so a bad or taken port is a one-line error at
once; the URL printed is the address actually bound, and `only_this_machine` says whether other machines can
reach it. `run_app` then freezes what is alive at the start out of Python's cyclic collector before it serves
(`freeze_startup_heap`). `BodyLimit` refuses request bodies over a size before they are held in memory.

    sock = listening_socket("127.0.0.1", 8000)             # K3Error if 8000 is taken or not a port
    sock = listening_socket("127.0.0.1", 8000, tries=20)   # 8000, else 8001 ... 8019, else any free port
    print(url_of(sock)); run_app(app, sock, "warning")
"""

from __future__ import annotations

import errno
import gc
import ipaddress
import json
import socket
from collections.abc import Callable

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


def only_this_machine(sock: socket.socket) -> bool:
    """Whether `sock` is bound to a loopback address (127.0.0.0/8, ::1): no other machine can reach it."""
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def require_key_beyond_this_machine(sock: socket.socket, host: str, key: str | None, how: str) -> None:
    """Closes `sock` and raises ListenError when other machines can reach it and no `key` was given: remote
    requests must authenticate. `how` says how to give a key."""
    if key is None and not only_this_machine(sock):
        sock.close()
        raise ListenError(f"--host {host} takes requests from other machines, which must authenticate: {how}")


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def freeze_startup_heap() -> int:
    """Move every object alive now into the collector's permanent generation (`gc.freeze`); returns how many.

    What a server holds when it starts (the model's modules and tensors, the tokenizer, the imported
    libraries: ~250 k tracked objects in `k3 serve` of `mini`) stays for its life, yet every pass of the
    collector's oldest generation walked all of it, holding the event loop and every stream: 224 ms once in
    320 requests of `k3 serve`'s engine with its prefix cache, none once frozen (benchmarks/serve_gc.py; vLLM
    and SGLang freeze their servers' heaps likewise). Collected first, so that no garbage is kept for good;
    objects created later are collected as before.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_app(app, sock: socket.socket, log_level: str) -> None:
    """Serve the ASGI `app` on `sock` with uvicorn until interrupted, the startup heap frozen first."""
    import uvicorn

    freeze_startup_heap()
    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])


def openai_error(status: int, message: str) -> dict:
    """An error body in the shape of OpenAI's API (the engine's and the atlas's servers)."""
    code = "request_too_large" if status == 413 else None
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


class BodyLimit:
    """ASGI middleware: a request whose body is over `max_bytes` gets 413 (its body `error(413, message)`, in
    the shape of the app's other errors; OpenAI's by default) instead of being held in memory: by its
    Content-Length before the app runs, or, sent in chunks, as soon as they pass the limit (the app then sees
    the client gone, and its reply is replaced by the 413). The rest of the body is read and dropped first,
    up to 8 x `max_bytes`, so that a client still sending gets the 413 rather than a broken connection
    (beyond that the connection is closed on it)."""

    def __init__(self, app, max_bytes: int, error: Callable[[int, str], dict] = openai_error) -> None:
        self.app, self.max_bytes, self.error = app, max_bytes, error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            if length.isdigit() and int(length) <= 8 * self.max_bytes:
                await self._drop_the_rest(receive, 0)
            await self._refuse(send)
            return
        seen, over, started = 0, False, False

        async def counted_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    if message.get("more_body", False):
                        await self._drop_the_rest(receive, seen)
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_over(message) -> None:
            nonlocal started
            if not over:
                started = True
                await send(message)

        try:
            await self.app(scope, counted_receive, send_unless_over)
        except Exception:
            if not over:  # the app's own failure; a body cut short may raise (starlette's ClientDisconnect)
                raise
        if over and not started:  # (an app that answered before reading its body has had its say)
            await self._refuse(send)

    async def _drop_the_rest(self, receive, seen: int) -> None:
        """Read the body's remaining chunks without keeping them, up to 8 x max_bytes in all."""
        while seen <= 8 * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _refuse(self, send) -> None:
        message = f"the request body is over this server's limit of {self.max_bytes:,} bytes"
        body = json.dumps(self.error(413, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
