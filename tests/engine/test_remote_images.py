"""Remote image URLs (`k3 serve --allow-remote-images`) against a real HTTP server on this machine: a host
that resolves to a private address (loopback, the cloud's metadata address, the private ranges, IPv6 and
IPv4-mapped forms) is refused before any connection; one the server names in `private_hosts` is fetched;
redirects are followed only to allowed http(s) targets; the connection goes to the address that was
checked (not to a second lookup); size caps, HTTP errors and timeouts are errors that say so."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from k3.engine import remote_images
from k3.engine.images import url_bytes
from k3.engine.remote_images import RemoteImages
from k3.vision.preprocess import ImageError

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8  # the bytes only travel: nothing decodes them here


DATA = Path(__file__).parent / "data"  # images_test.pem: a self-signed certificate for images.test (to 2126)


@contextlib.contextmanager
def image_server(routes: dict[str, tuple[int, dict, bytes]], tls: bool = False):
    """An HTTP server on 127.0.0.1 answering each path with (status, headers, body), over TLS as images.test
    with `tls`; yields (base URL, the (path, Host header) of every request it saw)."""
    seen: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Host", "")))
            status, headers, body = routes.get(self.path, (404, {}, b"no"))
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(DATA / "images_test.pem", DATA / "images_test.key")
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "url, address",
    [
        ("http://127.0.0.1:9/cat.png", "127.0.0.1"),
        ("http://localhost:9/cat.png", None),  # 127.0.0.1 or ::1, as this machine resolves it
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
        ("http://10.1.2.3/cat.png", "10.1.2.3"),
        ("http://192.168.0.7/cat.png", "192.168.0.7"),
        ("https://[::1]/cat.png", "::1"),
        ("http://[::ffff:127.0.0.1]/cat.png", "::ffff:127.0.0.1"),
        ("http://0.0.0.0/cat.png", "0.0.0.0"),
    ],
)
def test_private_addresses_are_refused_before_any_connection(url, address, monkeypatch):
    def no_connection(*args, **kwargs):
        raise AssertionError("a connection was opened")

    monkeypatch.setattr(remote_images.socket, "create_connection", no_connection)
    with pytest.raises(ImageError, match=f"resolves to {address or ''}.*not a public address"):
        url_bytes(url, remote=RemoteImages())


def test_a_named_private_host_is_fetched_and_redirects_are_checked_at_every_hop():
    routes = {
        "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
        "/moved": (302, {"Location": "/cat.png"}, b""),
        "/to-metadata": (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b""),
        "/to-ftp": (301, {"Location": "ftp://127.0.0.1/cat.png"}, b""),
        "/loop": (307, {"Location": "/loop"}, b""),
        "/big.png": (200, {}, PNG * 8),
        "/gone.png": (404, {}, b"no"),
    }
    with image_server(routes) as (base, seen):
        remote = RemoteImages(frozenset({"127.0.0.1"}), max_bytes=len(PNG) * 4)
        assert url_bytes(f"{base}/cat.png", remote=remote) == PNG
        assert url_bytes(f"{base}/moved", remote=remote) == PNG
        assert [p for p, _ in seen[-2:]] == ["/moved", "/cat.png"]
        for path, says in (
            ("/to-metadata", "169.254.169.254 resolves to 169.254.169.254, not a public address"),
            ("/to-ftp", "ftp://127.0.0.1/cat.png is not an http(s) URL"),
            ("/loop", "more than 3 redirects"),
            ("/big.png", f"holds more than {len(PNG) * 4:,} bytes"),
            ("/gone.png", "answered HTTP 404"),
        ):
            with pytest.raises(ImageError, match=says.replace("(", r"\(").replace(")", r"\)")):
                url_bytes(f"{base}{path}", remote=remote)
        with pytest.raises(ImageError, match="127.0.0.1, not a public address"):
            url_bytes(f"{base}/cat.png", remote=RemoteImages())  # not named: refused


def test_the_connection_goes_to_the_address_that_was_checked(monkeypatch):
    """A name is resolved once: the checked address is the one connected to (a second lookup could answer
    otherwise), and the name is kept for the Host header (and TLS)."""
    with image_server({"/cat.png": (200, {}, PNG)}) as (base, seen):
        port = int(base.rsplit(":", 1)[1])
        lookups = []
        resolve = socket.getaddrinfo

        def rebinding(host, *args, **kwargs):  # images.test: 127.0.0.1 the first time, then elsewhere
            if host != "images.test":
                return resolve(host, *args, **kwargs)
            lookups.append(host)
            return resolve("127.0.0.1" if len(lookups) == 1 else "192.0.2.1", *args, **kwargs)

        monkeypatch.setattr(remote_images.socket, "getaddrinfo", rebinding)
        remote = RemoteImages(frozenset({"images.test"}))
        assert url_bytes(f"http://images.test:{port}/cat.png", remote=remote) == PNG
        assert lookups == ["images.test"] and seen == [("/cat.png", f"images.test:{port}")]


def test_https_checks_the_certificate_against_the_name_not_the_address(monkeypatch):
    """Over https the pinned connection still verifies the server's certificate for the URL's name (SNI and
    hostname check): images.test's certificate, trusted here, serves images.test; the same server named
    other.test, or a certificate not trusted, is refused."""
    resolve = socket.getaddrinfo

    def local(host, *args, **kwargs):
        return resolve("127.0.0.1" if host.endswith(".test") else host, *args, **kwargs)

    monkeypatch.setattr(remote_images.socket, "getaddrinfo", local)
    remote = RemoteImages(frozenset({"images.test", "other.test"}))
    with image_server({"/cat.png": (200, {}, PNG)}, tls=True) as (base, seen):
        port = base.rsplit(":", 1)[1]
        with pytest.raises(ImageError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted yet
            url_bytes(f"https://images.test:{port}/cat.png", remote=remote)
        monkeypatch.setenv("SSL_CERT_FILE", str(DATA / "images_test.pem"))  # OpenSSL's trust store
        assert url_bytes(f"https://images.test:{port}/cat.png", remote=remote) == PNG
        assert seen[-1] == ("/cat.png", f"images.test:{port}")
        with pytest.raises(ImageError, match="CERTIFICATE_VERIFY_FAILED.*[Hh]ostname mismatch"):
            url_bytes(f"https://other.test:{port}/cat.png", remote=remote)


def test_a_silent_or_trickling_server_is_cut_off_at_the_timeout():
    """A server that never answers, and one that sends a byte every 50 ms (each read on time, the whole
    never), both end at the fetch's timeout with an error that says so."""
    with socket.socket() as quiet:  # accepts (the kernel's backlog) and never answers
        quiet.bind(("127.0.0.1", 0))
        quiet.listen(1)
        remote = RemoteImages(frozenset({"127.0.0.1"}), timeout=0.5)
        with pytest.raises(ImageError, match=r"took longer than 0.5 s"):
            url_bytes(f"http://127.0.0.1:{quiet.getsockname()[1]}/cat.png", remote=remote)

    class Trickle(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            with contextlib.suppress(OSError):  # the client goes away at its timeout
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(ImageError, match=r"took longer than 0.5 s"):
            url_bytes(f"http://127.0.0.1:{server.server_port}/cat.png", remote=remote)
        assert time.monotonic() - start < 5  # not the 50 s the bytes take
    finally:
        server.shutdown()
        server.server_close()


def test_remote_urls_are_refused_unless_the_server_allows_them():
    with pytest.raises(ImageError, match="remote URLs are refused"):
        url_bytes("https://example.com/cat.png")
    with pytest.raises(ImageError, match="file URL scheme is refused"):
        url_bytes("file:///etc/passwd", remote=RemoteImages())


def test_k3_serve_fetches_allowed_image_urls_only(tiny_checkpoint):
    """Through the server: a chat whose image is at an allowed URL is answered as the same image sent as a
    data URL; at a private address not named, a 400 that says so; without the rule, a 400 too."""
    import base64
    import io

    import numpy as np
    from fastapi.testclient import TestClient
    from PIL import Image

    from k3.engine.generate import Engine
    from k3.engine.server import create_app
    from k3.model import K3ForConditionalGeneration
    from k3.tokenizer.kimi import Tokenizer

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (45, 61, 3), dtype=np.uint8)).save(buf, "PNG")
    png = buf.getvalue()
    tok = Tokenizer.from_dir(tiny_checkpoint)
    engine = Engine(K3ForConditionalGeneration.from_pretrained(tiny_checkpoint))

    def ask(client: TestClient, url: str):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "¿Qué hay?"}]
        body = {
            "model": "t",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 3,
            "temperature": 0,
        }
        return client.post("/v1/chat/completions", json={**body, "logprobs": True})

    with image_server({"/cat.png": (200, {"Content-Type": "image/png"}, png)}) as (base, seen):
        rule = RemoteImages(frozenset({"127.0.0.1"}))
        with TestClient(create_app(engine, tok, "t", remote_images=rule)) as allowed:  # (its engine thread)
            fetched = ask(allowed, f"{base}/cat.png")
            sent = ask(allowed, "data:image/png;base64," + base64.b64encode(png).decode())
        assert fetched.status_code == 200 and seen == [("/cat.png", base.removeprefix("http://"))]
        assert fetched.json()["choices"][0]["logprobs"] == sent.json()["choices"][0]["logprobs"]
        for rule, says in ((RemoteImages(), "not a public address"), (None, "remote URLs are refused")):
            with TestClient(create_app(Engine(engine.model), tok, "t", remote_images=rule)) as client:
                r = ask(client, f"{base}/cat.png")
            assert r.status_code == 400 and says in r.json()["error"]["message"]
        assert len(seen) == 1
