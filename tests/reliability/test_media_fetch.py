"""MediaLoader and the http fetcher in-process (no server): the refusals that need no model, the
parts of SSRF defence a server test cannot see (DNS pinning, a body that never ends), and the
address classification."""

from __future__ import annotations

import ipaddress
import socket
import time

import pytest
from reliability_util import GOOD_PNG

from mmserve.frontend import http_fetch
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.media_error import MediaError

URLS = [
    "http://127.0.0.1/x.png",
    "http://localhost/x.png",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.1.2.3/x.png",
    "http://[::1]/x.png",
    "https://example.com/x.png",
]


@pytest.mark.parametrize("url", URLS)
def test_every_http_url_is_refused_by_default(url):
    with pytest.raises(MediaError, match="disabled"):
        MediaLoader().load(url)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "/etc/passwd", "file:///proc/self/environ"])
def test_local_files_are_refused_by_default(url):
    with pytest.raises(MediaError, match="disabled"):
        MediaLoader().load(url)


def test_the_listed_ip_is_fetched_and_localhost_is_not(image_host):
    loader = MediaLoader(allowed_media_domains=["127.0.0.1", "localhost"])
    assert loader.load(f"{image_host.base}/img.png") == GOOD_PNG
    with pytest.raises(MediaError, match="non-public"):
        loader.load(f"http://localhost:{image_host.port}/img.png")


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/",
        "http://localhost:{port}/img.png",
        "http://[::1]:{port}/img.png",
        "file:///x",
    ],
)
def test_a_redirect_from_the_allowed_host_to_an_internal_one_is_refused(image_host, target):
    loader = MediaLoader(allowed_media_domains=["127.0.0.1", "localhost"])
    before = image_host.hits.get("/img.png", 0)
    with pytest.raises(MediaError):
        loader.load(f"{image_host.base}/redirect?to=" + target.format(port=image_host.port))
    assert image_host.hits.get("/img.png", 0) == before


def test_the_connection_goes_to_the_checked_address_without_a_second_lookup(image_host, monkeypatch):
    """A DNS name is resolved once, checked, and that address is dialled (Host header kept): a
    rebinding DNS server gets no second question. images.invalid resolves nowhere at all."""
    monkeypatch.setattr(http_fetch, "_checked_address", lambda url, allowed: "127.0.0.1")
    url = f"http://images.invalid:{image_host.port}/img.png"
    assert http_fetch.fetch_image(url, ["images.invalid"], 1 << 20, 10) == GOOD_PNG
    assert image_host.host_headers[-1] == f"images.invalid:{image_host.port}"


def test_a_name_with_any_internal_address_is_refused(monkeypatch):
    def getaddrinfo(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in ("8.8.8.8", "10.0.0.7")]

    monkeypatch.setattr(http_fetch.socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(MediaError, match="non-public"):
        http_fetch.fetch_image("http://images.example/x.png", ["images.example"], 1 << 20, 5)


def test_a_body_that_never_ends_is_cut_off_at_the_time_limit(image_host):
    """One byte a second stays under any read timeout; the whole fetch has a deadline. (Before,
    the timeout applied per read: this would have run for 10 minutes, holding a thread.)"""
    start = time.monotonic()
    with pytest.raises(MediaError, match="too long"):
        http_fetch.fetch_image(f"{image_host.base}/slow", ["127.0.0.1"], 1 << 20, timeout_s=1.5)
    assert time.monotonic() - start < 4


@pytest.mark.parametrize(
    "address,public",
    [
        ("93.184.216.34", True),
        ("127.0.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:169.254.169.254", False),  # IPv4-mapped
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("2002:a9fe:a9fe::1", False),  # 6to4 of 169.254.169.254
        ("2606:4700:4700::1111", True),
    ],
)
def test_address_classification(address, public):
    assert http_fetch._is_public(ipaddress.ip_address(address)) is public
