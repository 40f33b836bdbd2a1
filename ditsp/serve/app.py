"""The HTTP API of `ditsp serve` (FastAPI): jobs in, restored files out, on a persistent elastic SP group.

:func:`create_app` wires the parts; each route group and each concern has its module:

- :mod:`.settings`: the server's flags, checked once;
- :mod:`.guard`: the Host, Origin, size and token checks every request passes, and the error bodies;
- :mod:`.inputs`: uploads and named inputs, pinned under the data dir at submission;
- :mod:`.jobs_routes`: ``/v1/jobs`` (submit, list, status, result, cancel);
- :mod:`.health_routes`: ``/healthz`` and ``/metrics``.

Routes (see docs/serve.md)::

    POST   /v1/jobs                 submit: multipart ``file`` or form ``path``, form ``options`` (JSON)
    GET    /v1/jobs                 list (``?state=&limit=``)
    GET    /v1/jobs/{id}            status and progress (and the report once done)
    GET    /v1/jobs/{id}/result     the restored file
    POST   /v1/jobs/{id}/cancel     cancel (a running job stops being served at its end)
    GET    /healthz                 group and queue state
    GET    /metrics                 Prometheus text
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI

from . import guard, health_routes, jobs_routes
from .controller import Controller
from .inputs import Inputs
from .metrics import Metrics
from .settings import Settings
from .store import JobStore

# also read from here by other modules (benchmarks, tests): the settings, a job's options, their types
from .jobs_routes import OPTIONS, job_options  # noqa: F401

__all__ = ["OPTIONS", "Settings", "create_app", "job_options"]
MiB = 2**20


def create_app(settings: Settings, start_workers: bool = True) -> FastAPI:
    store = JobStore(settings.data_dir)  # takes the data dir's lock: one server per data dir
    spec = settings.weights
    controller = Controller(store, spec, settings.sp, timeout_s=settings.timeout_s, threads=settings.threads,
                            respawn=settings.respawn, job_timeout_s=settings.job_timeout_s,
                            retention_s=None if settings.retention_hours is None else settings.retention_hours * 3600)
    metrics = Metrics(store)
    controller.metrics = metrics
    controller.plan_job = lambda job, sp: jobs_routes.plan_job(settings, job, sp)
    allowed = [os.path.realpath(d) for d in settings.allow_input]
    mask = _masker(store.root, allowed)
    inputs = Inputs(store.uploads, allowed, int(settings.max_upload_mb * MiB))

    @asynccontextmanager
    async def lifespan(app):
        store.recover()
        if start_workers:
            controller.start()
        try:
            yield
        finally:
            controller.stop()
            store.close()

    app = FastAPI(title="ditsp serve", lifespan=lifespan, dependencies=[Depends(guard.auth(settings))],
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.controller, app.state.store, app.state.metrics = controller, store, metrics
    guard.install(app, settings, mask)
    app.include_router(jobs_routes.router(settings, store, controller, inputs, mask))
    app.include_router(health_routes.router(spec, store, controller, metrics))
    return app


def _masker(root: Path, allowed: list[str]):
    """``mask(text)``: the data dir's paths as ``<data>``, the input folders' as ``<input>``."""
    pairs = {}
    for d in (os.path.abspath(root), os.path.realpath(root)):
        pairs[d] = "<data>"
    for d in allowed:
        pairs[d] = "<input>"
    order = sorted((k for k in pairs if k not in ("", ".", "/")), key=len, reverse=True)

    def mask(text: str) -> str:
        for k in order:
            text = text.replace(k, pairs[k])
        return text

    return mask
