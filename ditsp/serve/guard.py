"""What every request passes before a route runs, and the one shape of every error body.

- **Host**: one of the server's own names (:meth:`Settings.host_names`), so a
  page whose name was rebound to this machine's address (DNS rebinding) is
  refused: 400.
- **Origin**: a browser's cross-origin request (an ``Origin`` other than the
  server's own, or ``Sec-Fetch-Site: cross-site``/``same-site`` without one)
  is refused unless its origin was allowed with ``--allow-origin``: 403. An
  allowed origin gets CORS answers, so its pages can call the API.
- **Body size**: a POST larger than the upload limit is refused from its
  Content-Length before it is read: 413 (411 without one).
- **Token**: ``Authorization: Bearer <token>`` on every route when the server
  has one, compared in constant time: 401.

Every error is JSON ``{"detail": "<one line>"}`` with the server's absolute
paths masked (``<data>``, ``<input>``); a request that fails validation is a
400, and an unexpected failure a 500 in the same shape (never a plain-text page).
"""

from __future__ import annotations

import hmac
import logging
from urllib.parse import urlsplit

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import one_line
from .settings import Settings

MiB = 2**20
log = logging.getLogger("ditsp.serve")


def error(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def auth(settings: Settings):
    """The bearer-token dependency of every route (nothing to check without a token)."""
    token = settings.token.encode() if settings.token else None

    def check(request: Request) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.strip().encode(), token):
            raise HTTPException(401, "wrong token", headers={"WWW-Authenticate": "Bearer"})

    return check


def install(app: FastAPI, settings: Settings, mask) -> None:
    """The error handlers and the Host, Origin and size checks of ``app``."""
    hosts = settings.host_names()
    origins = frozenset(settings.allow_origins)
    limit = int(settings.max_upload_mb * MiB)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        detail = mask(exc.detail) if isinstance(exc.detail, str) else exc.detail
        return error(exc.status_code, detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
        return error(400, one_line(f"{where}: {first.get('msg', 'invalid')}", 300))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("%s %s failed: %s", request.method, request.url.path, one_line(f"{type(exc).__name__}: {exc}"))
        return error(500, mask(one_line(f"internal error: {type(exc).__name__}: {exc}", 300)))

    if origins:  # inside the guard: an allowed origin's preflight and answers get their CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization"])

    @app.middleware("http")
    async def guard(request: Request, call_next):
        host = request.headers.get("host")
        if host is None:
            return error(400, "a Host header is required")
        name = _name_of(host)
        if hosts is not None and name not in hosts:
            return error(400, f"Host {one_line(host, 100)!r} is not a name of this server "
                              f"(start it with --allow-host NAME to accept one)")
        origin = request.headers.get("origin")
        if origin is not None:
            o = origin.strip().lower().rstrip("/")
            same = urlsplit(o).netloc == host.strip().lower() and o.startswith(("http://", "https://"))
            if not same and o not in origins:
                return error(403, f"cross-origin request from {one_line(origin, 100)!r} refused "
                                  f"(start the server with --allow-origin ORIGIN to allow a web page)")
        elif request.headers.get("sec-fetch-site") in ("cross-site", "same-site"):
            return error(403, "cross-origin request refused (the browser sent no Origin)")
        if request.method in ("POST", "PUT", "PATCH"):
            length = request.headers.get("content-length")
            if length is None:
                if request.headers.get("transfer-encoding"):
                    return error(411, "a Content-Length is required")
            elif not (length.isascii() and length.isdigit()) or len(length) > 18:
                return error(400, "bad Content-Length")
            elif int(length) > limit + MiB:  # the multipart framing around the file
                return error(413, f"upload larger than {settings.max_upload_mb:g} MiB")
        return await call_next(request)


def _name_of(host: str) -> str:
    """The name of a Host header, without its port, brackets or trailing dot, lower case."""
    h = host.strip().lower()
    if h.startswith("["):
        return h[1:].partition("]")[0]
    return h.rpartition(":")[0].rstrip(".") if ":" in h else h.rstrip(".")
