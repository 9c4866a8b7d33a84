"""Fetching images over http(s) without becoming a server-side request forgery tool.

A URL is fetched only if its host is on the operator's allowlist and every address the host
resolves to is public (loopback, link-local, private and reserved ranges are refused, unless
the allowlist names that very IP). Redirects are followed by hand, each hop checked again;
the body is read in chunks up to the size limit, within the time limit.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urljoin, urlparse

import httpx

from mmserve.frontend.media import MediaError

MAX_REDIRECTS = 3


def _check_host(url: str, allowed_domains: list[str]) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise MediaError(f"redirect to unsupported scheme {parsed.scheme!r}")
    host = (parsed.hostname or "").lower()
    if not allowed_domains:
        raise MediaError(
            "fetching images over http(s) is disabled; start the server with --allowed-media-domains"
        )
    if host not in allowed_domains:
        raise MediaError(f"image host {host!r} is not in the allowed media domains")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        return  # an IP the operator listed explicitly
    try:
        infos = socket.getaddrinfo(host, parsed.port or (443 if parsed.scheme == "https" else 80))
    except socket.gaierror:
        raise MediaError(f"cannot resolve image host {host!r}") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global:
            raise MediaError(f"image host {host!r} resolves to a non-public address")


def fetch_image(url: str, allowed_domains: list[str], max_bytes: int, timeout_s: float) -> bytes:
    with httpx.Client(follow_redirects=False, timeout=timeout_s) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_host(url, allowed_domains)
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"fetching the image returned HTTP {response.status_code}")
                    body = bytearray()
                    for chunk in response.iter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            raise MediaError(f"image exceeds the {max_bytes} byte limit")
                    return bytes(body)
            except httpx.HTTPError as e:
                raise MediaError(f"fetching the image failed: {type(e).__name__}") from None
    raise MediaError(f"more than {MAX_REDIRECTS} redirects")
