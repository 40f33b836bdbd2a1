"""The health and metrics routes of `ditsp serve`: the group's state for people and load balancers, and
Prometheus text."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response


def router(spec, store, controller, metrics) -> APIRouter:
    api = APIRouter()

    @api.get("/healthz")
    def health():
        st = controller.status()
        ok = st["ready"] and not st["error"] and st["ranks"] > 0
        status = "ok" if ok else ("failed" if st["error"] else "starting" if not st["ready"] else "degraded")
        body = {"status": status, **st, "queued": store.count("queued"), "running": store.count("running"),
                "model": asdict(spec)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @api.get("/metrics")
    def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    return api
