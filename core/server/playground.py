"""The playground: a page at ``GET /`` to chat with the server and watch speculation work.

The static files of the package (``playground/``: the page, its script, style and icon; no
build step, no external URL, so it works offline) read once when the app is built. The page
calls the server's own API from the browser (``/v1/models`` for the method and k, then
``/v1/chat/completions`` streamed with ``include_token_sources``), so the API key, when the
server has one, guards everything the page can do: the files themselves are public, like
``/health``. ``--allowed-hosts`` applies to them as to every path.

A Content-Security-Policy lets the page load and call nothing but this server.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

#: The files the playground serves, by URL path, with their media types.
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
    "/playground/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_playground(app: FastAPI) -> None:
    """Serve the playground's files on ``app`` (``GET /`` and ``GET /playground/<file>``)."""
    folder = resources.files(__package__) / "playground"
    for path, (name, media_type) in _FILES.items():
        app.add_api_route(path, _responder((folder / name).read_bytes(), media_type), methods=["GET"],
                          include_in_schema=False)


def _responder(body: bytes, media_type: str):
    async def respond() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    return respond
