"""The HTTP API of `ditsp serve` (FastAPI): jobs in, restored files out, on a persistent elastic SP group.

Every route needs ``Authorization: Bearer <token>`` when the server has a
token (compared in constant time). Requests are checked before a job is
accepted, with the checks of `ditsp upscale` (the input opens and has frames,
the options make sense, the request fits in memory); every bad request gets a
4xx with a one-line ``detail``.

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

import hmac
import json
import os
import re
import stat
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import one_line
from ..fixed_shape import SERVE_DETERMINISTIC
from ..models.seedvr2 import request as job_request
from .store import STATES, JobStore, new_id
from ..models.seedvr2.weights import WeightsSpec
from ..io.formats import IMAGE_EXTS, VIDEO_EXTS
from .controller import Controller
from .metrics import Metrics
from ..io.media import MediaError
from ..io.probe import probe

ID_RE = re.compile(r"^[0-9a-f]{32}$")
MiB = 2**20
OPTIONS = job_request.HTTP_OPTIONS  # the job options, their types and values: owned by the request module


@dataclass
class Settings:
    """What a server is started with (the `ditsp serve` flags)."""

    data_dir: str
    sp: int = 1
    model: str = "tiny"
    dit: str | None = None
    vae: str | None = None
    text_embedding: str | None = None
    dtype: str | None = None
    token: str | None = None
    allow_input: list[str] = field(default_factory=list)
    max_upload_mb: float = 512.0
    threads: int = 1
    timeout_s: float = 60.0
    job_timeout_s: float = 3600.0
    respawn: bool = True
    deterministic: bool = SERVE_DETERMINISTIC  # fixed-shape kernel calls: a re-run job (any SP degree) writes the same frames
    compile: bool = False  # torch.compile'd models, kept compiled in each worker's model cache across jobs
    weights_read: str | None = None  # how the ranks read the checkpoints (ditsp/weights/shared.py; None: its default)
    retention_hours: float | None = None  # results of finished jobs deleted after this long (None: kept)

    @property
    def weights(self):
        return WeightsSpec(self.model, self.dit, self.vae, self.text_embedding,
                           self.dtype or job_request.default_dtype(self.model), read=self.weights_read)


def _bad(status: int, msg: str) -> HTTPException:
    return HTTPException(status_code=status, detail=msg)


def _check_options(raw: str) -> dict:
    try:
        opts = json.loads(raw or "{}")
    except json.JSONDecodeError as e:
        raise _bad(400, f"options: not valid JSON ({e.msg})") from None
    try:
        return job_request.parse_http_options(opts)
    except ValueError as e:
        raise _bad(400, str(e)) from None


def _inside(path: str, folders: list[str]) -> bool:
    for f in folders:
        try:
            if os.path.commonpath([path, f]) == f:
                return True
        except ValueError:
            continue
    return False


def create_app(settings: Settings, start_workers: bool = True) -> FastAPI:
    store = JobStore(settings.data_dir)
    spec = settings.weights
    controller = Controller(store, spec, settings.sp, timeout_s=settings.timeout_s, threads=settings.threads,
                            respawn=settings.respawn, job_timeout_s=settings.job_timeout_s,
                            retention_s=None if settings.retention_hours is None else settings.retention_hours * 3600)
    metrics = Metrics(store)
    controller.metrics = metrics
    allowed = [os.path.realpath(d) for d in settings.allow_input]
    mask = _masker(store.root, allowed)
    limit = int(settings.max_upload_mb * MiB)
    token = settings.token.encode() if settings.token else None
    input_exts = tuple(IMAGE_EXTS) + tuple(VIDEO_EXTS)

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

    def auth(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.strip().encode(), token):
            raise HTTPException(401, "wrong token", headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="ditsp serve", lifespan=lifespan, dependencies=[Depends(auth)], docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.controller, app.state.store, app.state.metrics = controller, store, metrics

    @app.exception_handler(StarletteHTTPException)
    async def masked(request: Request, exc: StarletteHTTPException):
        """Every error body without the server's absolute paths (data dir and input folders)."""
        detail = mask(exc.detail) if isinstance(exc.detail, str) else exc.detail
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.middleware("http")
    async def body_limit(request: Request, call_next):
        if request.method in ("POST", "PUT", "PATCH"):
            length = request.headers.get("content-length")
            if length is None:
                if request.headers.get("transfer-encoding"):
                    return JSONResponse({"detail": "a Content-Length is required"}, status_code=411)
            else:
                try:
                    n = int(length)
                except ValueError:
                    return JSONResponse({"detail": "bad Content-Length"}, status_code=400)
                if n > limit + MiB:  # the multipart framing around the file
                    return JSONResponse({"detail": f"upload larger than {settings.max_upload_mb:g} MiB"},
                                        status_code=413)
        return await call_next(request)

    def _job_or_404(job_id: str) -> dict:
        if not ID_RE.match(job_id):
            raise _bad(404, "no such job")
        job = store.get(job_id)
        if job is None:
            raise _bad(404, "no such job")
        if job.get("error"):
            job["error"] = mask(job["error"])
        return job

    def _resolve_named(path: str) -> str:
        if not allowed:
            raise _bad(403, "this server reads no input folders (start it with --allow-input DIR)")
        if "\x00" in path:
            raise _bad(400, "path: bad characters")
        candidates = [path] if os.path.isabs(path) else [os.path.join(d, path) for d in allowed]
        for c in candidates:
            real = os.path.realpath(c)
            if not _inside(real, allowed):  # '..', an absolute path elsewhere, or a link leading out
                raise _bad(403, "path: outside the allowed input folders")
            if os.path.exists(real):
                _check_regular(real)
                return real
        raise _bad(404, "path: no such file under the allowed input folders")

    def _check_regular(real: str) -> None:
        """Regular files, or folders whose frames are regular files inside the allowed folders, only.

        A named pipe, socket or device would block the request thread on open
        (until someone writes to it) or read without end.
        """
        st = os.stat(real)
        if stat.S_ISREG(st.st_mode):
            return
        if not stat.S_ISDIR(st.st_mode):
            raise _bad(400, "path: not a regular file or a folder (pipes, sockets and devices are refused)")
        with os.scandir(real) as it:
            for entry in it:
                if entry.name.startswith(".") or Path(entry.name).suffix.lower() not in input_exts:
                    continue
                inner = os.path.realpath(entry.path)
                if not _inside(inner, allowed):
                    raise _bad(403, f"path: {entry.name} in the folder leads outside the allowed input folders")
                if not stat.S_ISREG(os.stat(inner).st_mode):
                    raise _bad(400, f"path: {entry.name} in the folder is not a regular file "
                                    f"(pipes, sockets and devices are refused)")

    def _save_upload(file: UploadFile, dest: Path) -> None:
        total = 0
        try:
            with open(dest, "xb") as out:
                while chunk := file.file.read(MiB):
                    total += len(chunk)
                    if total > limit:
                        raise _bad(413, f"upload larger than {settings.max_upload_mb:g} MiB")
                    out.write(chunk)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        if total == 0:
            dest.unlink(missing_ok=True)
            raise _bad(400, "file: empty upload")

    @app.post("/v1/jobs", status_code=201)
    def submit(file: UploadFile | None = File(None), path: str | None = Form(None), options: str = Form("{}")):
        if (file is None) == (path is None):
            raise _bad(400, "give exactly one of: an uploaded 'file', or a 'path' under an allowed input folder")
        opts = _check_options(options)
        job_id = new_id()
        owned = file is not None
        if owned:
            ext = Path(file.filename or "").suffix.lower()
            if ext not in input_exts or not re.fullmatch(r"\.[a-z0-9]{1,5}", ext):
                raise _bad(415, f"file: unsupported type {ext or '(no extension)'}; "
                                f"send one of {', '.join(input_exts)}")
            src = store.uploads / f"{job_id}{ext}"  # the client's name is kept for display only
            _save_upload(file, src)
            src = str(src)
            name = os.path.basename(file.filename or "")[:200]
        else:
            src = _resolve_named(path)
            name = os.path.basename(src)[:200]
        try:
            try:
                kind = probe(src).kind
            except (MediaError, OSError, ValueError) as e:
                raise _bad(400, f"input: cannot be read as a video, image or folder of frames ({_one(e)})") from None
            fmt = opts.get("format") or ("png" if kind == "image" else "mp4")
            out = store.results / f"{job_id}.{fmt}"
            job = job_options(settings, src, str(out), opts)
            try:
                checked = job_request.check(job)
                job_request.check_memory(checked, job)
                req = checked.req
            except MemoryError as e:
                raise _bad(422, _one(e)) from None
            except (ValueError, OSError) as e:
                raise _bad(400, _one(e)) from None
        except HTTPException:
            if owned:
                Path(src).unlink(missing_ok=True)
            raise
        request = {k: v for k, v in asdict(req).items() if k not in ("weights", "overwrite", "progress",
                                                                      "sample_frames")}
        store.add(job_id, src, owned, name, str(out), request, opts)
        return store.get(job_id)

    @app.get("/v1/jobs")
    def list_jobs(state: str | None = None, limit: int = 100):
        if state is not None and state not in STATES:
            raise _bad(400, f"state must be one of {', '.join(STATES)}")
        if not 1 <= limit <= 1000:
            raise _bad(400, "limit must be in 1..1000")
        jobs = store.list(state, limit)
        for j in jobs:
            if j.get("error"):
                j["error"] = mask(j["error"])
        return {"jobs": jobs}

    @app.get("/v1/jobs/{job_id}")
    def job_status(job_id: str):
        job = _job_or_404(job_id)
        total = job["progress_total"]
        job["progress"] = job["progress_done"] / total if total else (1.0 if job["state"] == "done" else 0.0)
        return job

    @app.get("/v1/jobs/{job_id}/result")
    def job_result(job_id: str):
        job = _job_or_404(job_id)
        if job["state"] != "done":
            raise _bad(409, f"job is {job['state']}; the result exists once it is done")
        full = store.get(job_id, full=True)
        p = full["output_path"]
        if not os.path.isfile(p):
            raise _bad(410, "the result file is gone")
        return FileResponse(p, filename=f"{job_id}{Path(p).suffix}")

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str):
        before = _job_or_404(job_id)["state"]
        state = store.cancel(job_id)
        if before == "queued" and state == "cancelled":  # it never runs: its upload goes now
            full = store.get(job_id, full=True)
            if full["input_owned"]:
                Path(full["input_path"]).unlink(missing_ok=True)
        return store.get(job_id) | {"state": state}

    @app.get("/healthz")
    def health():
        st = controller.status()
        ok = st["ready"] and not st["error"] and st["ranks"] > 0
        body = {"status": "ok" if ok else ("starting" if not st["ready"] else "degraded"), **st,
                "queued": store.count("queued"), "running": store.count("running"),
                "model": asdict(spec)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

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


def _one(e: BaseException) -> str:
    return one_line(str(e), 300)


def job_options(settings: Settings, src: str, out: str, opts: dict) -> job_request.Options:
    """A job's request options: its HTTP options and the server's settings (checked exactly as the CLI's)."""
    return job_request.from_http(opts, input=src, output=out, sp=settings.sp, model=settings.model, dit=settings.dit,
                             vae=settings.vae, text_embedding=settings.text_embedding, dtype=settings.dtype,
                             threads=settings.threads, timeout=settings.job_timeout_s,
                             deterministic=settings.deterministic, compile=settings.compile)
