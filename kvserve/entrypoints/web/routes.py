"""Routes of the web page and of the JSON it reads.

The page (`/`, `/static/*`, `/favicon.ico`) is static and open, as /health and /metrics are: it holds no
data, and with --api-key it asks the user for the key before calling /v1. `/api/dashboard` and `/api/info`
are open too: the dashboard shows what /metrics already exposes, and /api/info only says whether a key is
needed (so the page can ask for it before making a request that would fail)."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from kvserve.metrics.dashboard import MetricsHistory

STATIC_DIR = Path(__file__).with_name("static")

# The page loads only its own files and talks only to this server. Even if the renderer let markup from a
# model's reply through, the browser would refuse to run it: no inline scripts or handlers, no other origins.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",      # revalidate, so an upgraded server's page is picked up at once
}


def add_page_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        # Browsers ask for /favicon.ico on any page of the server (/docs, /metrics); the page itself links it.
        return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")

    app.mount("/static", RevalidatedStaticFiles(directory=STATIC_DIR), name="static")


class RevalidatedStaticFiles(StaticFiles):
    """The page's modules with "no-cache" as the page has it: without it a browser reused them by its own
    heuristic for days (their names carry no version), so an upgraded server's page ran old modules. A
    revalidation is a 304 by ETag, no body."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = PAGE_HEADERS["Cache-Control"]
        return response


def add_api_routes(app: FastAPI, history: MetricsHistory, *, api_key_required: bool, version: str,
                   web_page: bool, models: list[str] | None = None) -> None:
    max_window = int(history.keep_s)

    @app.get("/api/dashboard")
    async def dashboard(window: int = Query(max_window, ge=10, le=max_window,
                                            description="Seconds of history to return.")) -> JSONResponse:
        """Time series of the serving metrics for the web dashboard (see kvserve/metrics/dashboard.py)."""
        # Straight to JSON: FastAPI's encoder would walk each of the ~4k numbers on every poll.
        return JSONResponse(history.dashboard(float(window)))

    @app.get("/api/info")
    async def info() -> dict:
        return {"object": "server_info", "version": version, "api_key_required": api_key_required,
                "web_page": web_page, "dashboard_interval_s": history.interval_s, "models": models or []}
