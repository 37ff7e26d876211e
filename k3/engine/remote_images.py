"""http(s) image URLs, fetched for a client where the server allows it (`k3 serve --allow-remote-images`).

A URL a client sends makes the server open a connection, so a careless fetch lets any client reach what only
the server can: its loopback services, the cloud's metadata address (169.254.169.254), the private network.
So a host must resolve to public addresses only (every address it resolves to: a name with one private
address among public ones is refused), unless the server names it in `private_hosts` (an internal image
store). The connection goes to the address that was checked, not to a second lookup (which a name could
answer differently: DNS rebinding), with the name kept for TLS (certificate and SNI) and the Host header.
Redirects are followed by hand, at most MAX_REDIRECTS, each target checked as the first; the body is read
up to its cap, the whole fetch within a timeout (a server sending a byte now and then holds a worker thread
no longer). Proxy variables are not used: the check would see the proxy, not the host.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field

from k3.vision.preprocess import MAX_IMAGE_BYTES, ImageError

MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class RemoteImages:
    """The server's rule for http(s) image URLs: public addresses, and the hosts in `private_hosts` (names
    or addresses, as written in URLs) whatever they resolve to."""

    private_hosts: frozenset[str] = field(default_factory=frozenset)
    timeout: float = 10.0  # seconds for the whole fetch (and at most for each wait on the server)
    max_bytes: int = MAX_IMAGE_BYTES

    def fetch(self, url: str) -> bytes:
        """The body of an http(s) URL (ImageError names what is refused or failed), redirects included
        within `timeout` (a server that sends a byte now and then is cut off there)."""
        deadline = time.monotonic() + self.timeout
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ImageError(f"image_url: {url} is not an http(s) URL")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise ImageError(f"image_url: {url} has a bad port") from None
            address = self._address(parts.hostname, port)
            try:
                response, body = self._get(parts, address, port, deadline)
            except TimeoutError:
                raise ImageError(f"image_url: {url} took longer than {self.timeout:g} s") from None
            except (OSError, http.client.HTTPException) as e:
                raise ImageError(f"image_url: could not fetch {url} ({e})") from None
            if response.status in REDIRECTS and response.getheader("Location"):
                url = urllib.parse.urljoin(url, response.getheader("Location"))
                continue
            if response.status != 200:
                raise ImageError(f"image_url: {url} answered HTTP {response.status}")
            if len(body) > self.max_bytes:
                raise ImageError(f"image_url: {url} holds more than {self.max_bytes:,} bytes")
            return body
        raise ImageError(f"image_url: more than {MAX_REDIRECTS} redirects")

    def _address(self, host: str, port: int) -> str:
        """The address to connect to: the first the host resolves to, once every one of them is allowed."""
        try:
            found = [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        except OSError as e:
            raise ImageError(f"image_url: cannot resolve {host} ({e})") from None
        if host not in self.private_hosts:
            for a in found:
                ip = ipaddress.ip_address(a.split("%")[0])  # (an IPv6 scope id)
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
                if not ip.is_global or ip.is_multicast:
                    raise ImageError(
                        f"image_url: {host} resolves to {a}, not a public address "
                        "(a server names such hosts in --private-image-hosts)"
                    )
        return found[0]

    def _get(self, parts: urllib.parse.SplitResult, address: str, port: int, deadline: float):
        """GET the URL's path from `address` (the checked one), the host name kept for TLS and Host; the
        body up to one byte over the cap, by `deadline` (TimeoutError past it)."""
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = _PinnedHTTPS(parts.hostname, address, port, self.timeout)
        else:
            conn = _PinnedHTTP(parts.hostname, address, port, self.timeout)
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "k3"})
            response = conn.getresponse()
            body = bytearray()
            while len(body) <= self.max_bytes:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = response.read1(min(2**16, self.max_bytes + 1 - len(body)))
                if not chunk:
                    break
                body += chunk
            return response, bytes(body)
        finally:
            conn.close()


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(_PinnedHTTP):
    default_port = 443

    def connect(self) -> None:
        super().connect()
        self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)
