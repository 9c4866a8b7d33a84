"""Fetching images over http(s) without becoming a server-side request forgery tool.

A URL is fetched only if its host is on the operator's allowlist and every address the host
resolves to is public (loopback, link-local, private and reserved ranges are refused, unless
the allowlist names that very IP). The connection goes to the address that was checked (no
second DNS lookup a rebinding DNS server could answer differently), and the URL is parsed by
the same parser that fetches it. Redirects are followed by hand, each hop checked again; the
body is read undecoded in chunks up to the size limit, and the whole fetch within the time limit.
"""

from __future__ import annotations

import ipaddress
import socket
import time

import httpx

from mmserve.frontend.media_error import MediaError

MAX_REDIRECTS = 3


def _parse(url: str | httpx.URL) -> httpx.URL:
    try:
        return httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise MediaError("the image URL is malformed") from None


def _checked_address(url: httpx.URL, allowed_domains: list[str]) -> str:
    """The IP address to connect to for `url`, after every check passed."""
    if url.scheme not in ("http", "https"):
        raise MediaError(f"redirect to unsupported scheme {url.scheme!r}")
    host = url.host.lower()
    if not allowed_domains:
        raise MediaError(
            "fetching images over http(s) is disabled; start the server with --allowed-media-domains"
        )
    if host not in allowed_domains:
        raise MediaError(f"image host {host[:100]!r} is not in the allowed media domains")
    try:
        return str(ipaddress.ip_address(host))  # an IP the operator listed explicitly
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(
            host, url.port or (443 if url.scheme == "https" else 80), type=socket.SOCK_STREAM
        )
    except (socket.gaierror, UnicodeError):
        raise MediaError(f"cannot resolve image host {host!r}") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses or not all(_is_public(a) for a in addresses):
        raise MediaError(f"image host {host!r} resolves to a non-public address")
    return str(addresses[0])


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Global, and so is any IPv4 address embedded in it (mapped, NAT64, 6to4), which a
    dual-stack host or a NAT64 gateway would reach instead."""
    if not address.is_global:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return embedded.is_global
    return True


def fetch_image(url: str, allowed_domains: list[str], max_bytes: int, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    target = _parse(url)
    with httpx.Client(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            address = _checked_address(target, allowed_domains)
            try:
                response = _fetch(client, target, address, max_bytes, deadline)
            except httpx.HTTPError as e:
                raise MediaError(f"fetching the image failed: {type(e).__name__}") from None
            if isinstance(response, bytes):
                return response
            target = _parse(target.join(response))
    raise MediaError(f"more than {MAX_REDIRECTS} redirects")


def _fetch(
    client: httpx.Client, target: httpx.URL, address: str, max_bytes: int, deadline: float
) -> bytes | str:
    """The body, or the Location of a redirect. Connects to `address`, naming the host in the
    Host header and (https) in SNI, so the certificate is still checked against the host."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise MediaError("fetching the image took too long")
    headers = {"Host": target.netloc.decode("ascii"), "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    with client.stream(
        "GET",
        target.copy_with(host=address),
        headers=headers,
        extensions=extensions,
        timeout=remaining,
    ) as response:
        if response.is_redirect:
            return response.headers.get("location", "")
        if response.status_code != 200:
            raise MediaError(f"fetching the image returned HTTP {response.status_code}")
        body = bytearray()
        for chunk in response.iter_raw():  # undecoded: a gzip bomb stays a small, bad image
            body += chunk
            if len(body) > max_bytes:
                raise MediaError(f"image exceeds the {max_bytes} byte limit")
            if time.monotonic() > deadline:
                raise MediaError("fetching the image took too long")
        return bytes(body)
