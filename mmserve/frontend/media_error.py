"""The error of a media reference a client sent (its own module: both the loader, media.py, and
its http fetcher, http_fetch.py, raise it)."""

from __future__ import annotations


class MediaError(ValueError):
    """The client's image reference cannot be used; the message is safe to show them."""
