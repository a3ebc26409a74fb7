"""``GET /dashboard``: the live load page (``gateway/static/dashboard.html``).

The page is one self-contained file (inline CSS and vanilla JS, no external assets)
that polls ``GET /admin/stats`` every 1–2 s with the admin key taken from the URL
fragment (``/dashboard#key=...``, never sent to the server in the page request) or
typed into the page. The page itself holds no data, so it is served without a key;
the stats feed checks the admin key.

The response carries a Content-Security-Policy that allows exactly the page's own
inline script and style (by SHA-256) and connections to its own origin, so the
browser refuses any other script and any request to another host.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from pathlib import Path

from aiohttp import web

PAGE = Path(__file__).resolve().parent / "static" / "dashboard.html"
_INLINE = {"script": re.compile(rb"<script>(.*?)</script>", re.S),
           "style": re.compile(rb"<style>(.*?)</style>", re.S)}


def _csp_hashes(kind: str, html: bytes) -> str:
    return " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(m.group(1)).digest()).decode() + "'"
        for m in _INLINE[kind].finditer(html))


@functools.cache
def _page() -> tuple[bytes, str]:
    """The page bytes and their CSP header, read once per process."""
    html = PAGE.read_bytes()
    csp = ("default-src 'none'; "
           f"script-src {_csp_hashes('script', html)}; "
           f"style-src {_csp_hashes('style', html)}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
           "form-action 'none'; frame-ancestors 'none'")
    return html, csp


async def dashboard(request: web.Request) -> web.Response:
    html, csp = _page()
    return web.Response(body=html, content_type="text/html", charset="utf-8", headers={
        "Content-Security-Policy": csp,
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    })
