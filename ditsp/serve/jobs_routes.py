"""The job routes of `ditsp serve`: submit, list, status, result, cancel (see docs/serve.md).

A job is checked before it is accepted, with the checks of `ditsp upscale`
(the input opens and has frames, the options make sense, the request fits in
memory); every refusal is a 4xx (or 503/507) with a one-line ``detail``.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from dataclasses import asdict, replace
from pathlib import Path

from fastapi import APIRouter, File, Form, HTTPException, UploadFile
from fastapi.responses import FileResponse

from ..errors import one_line
from ..io.media import MediaError
from ..io.probe import probe
from ..models.seedvr2.job import request as job_request
from .inputs import DISK_FULL, Inputs, bad, disk_full, release
from .settings import Settings
from .store import STATES, new_id

OPTIONS = job_request.HTTP_OPTIONS  # the job options, their types and values: owned by the request module
ID_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_OPTIONS_BYTES = 64 * 1024  # a job's options are a handful of fields: anything larger is not options


def parse_options(raw: str) -> dict:
    """A job's ``options`` field: a JSON object of known options (400, or 413 when absurdly large)."""
    raw = raw or "{}"
    if len(raw) > MAX_OPTIONS_BYTES:
        raise bad(413, f"options: larger than {MAX_OPTIONS_BYTES // 1024} KiB")
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError as e:
        raise bad(400, f"options: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise bad(400, "options: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        why = "a number with too many digits" if "digits" in str(e) else one_line(str(e), 200)
        raise bad(400, f"options: not valid JSON ({why})") from None
    try:
        return job_request.parse_http_options(opts)
    except ValueError as e:
        raise bad(400, str(e)) from None


def job_options(settings: Settings, src: str, out: str, opts: dict) -> job_request.Options:
    """A job's request options: its HTTP options and the server's settings (checked exactly as the CLI's)."""
    return job_request.from_http(opts, input=src, output=out, sp=settings.sp, model=settings.model,
                                 random_weights=settings.random_weights, dit=settings.dit,
                                 vae=settings.vae, text_embedding=settings.text_embedding, dtype=settings.dtype,
                                 threads=settings.threads, timeout=settings.job_timeout_s,
                                 deterministic=settings.deterministic, compile=settings.compile)


def plan_job(settings: Settings, job: dict, sp: int):
    """A stored job's request, checked and planned again for a group of ``sp`` ranks (the server's re-plan)."""
    o = job_options(settings, job["input_path"], job["output_path"], job["options"])
    o.sp, o.overwrite, o.force = sp, True, True  # the job was admitted at submit; its output is the server's
    return replace(job_request.check(o).req, progress=True, sample_frames=0)


def router(settings: Settings, store, controller, inputs: Inputs, mask) -> APIRouter:
    api = APIRouter()

    def job_or_404(job_id: str) -> dict:
        if not ID_RE.match(job_id):
            raise bad(404, "no such job")
        job = store.get(job_id)
        if job is None:
            raise bad(404, "no such job")
        if job.get("error"):
            job["error"] = mask(job["error"])
        return job

    @api.post("/v1/jobs", status_code=201)
    def submit(file: UploadFile | None = File(None), path: str | None = Form(None), options: str = Form("{}")):
        if (file is None) == (path is None):
            raise bad(400, "give exactly one of: an uploaded 'file', or a 'path' under an allowed input folder")
        refusal = controller.refusal()
        if refusal is not None:
            raise HTTPException(503, refusal, headers={"Retry-After": "10"})
        opts = parse_options(options)
        job_id = new_id()
        if file is not None:
            src = inputs.save_upload(file, job_id)
            name = os.path.basename(file.filename or "")[:200]
        else:
            src, name = inputs.pin_named(path, job_id)
        try:
            try:
                kind = probe(src).kind
            except (MediaError, OSError, ValueError) as e:
                raise bad(400, f"input: cannot be read as a video, image or folder of frames ({_one(e)})") from None
            fmt = opts.get("format") or ("png" if kind == "image" else "mp4")
            out = store.results / f"{job_id}.{fmt}"
            job = job_options(settings, src, str(out), opts)
            try:
                checked = job_request.check(job)
                job_request.check_memory(checked, job)
                req = checked.req
            except MemoryError as e:
                raise bad(422, _one(e)) from None
            except (ValueError, OSError, OverflowError) as e:
                raise bad(400, _one(e)) from None
            request = {k: v for k, v in asdict(req).items() if k not in ("weights", "overwrite", "progress",
                                                                          "sample_frames")}
            try:
                store.add(job_id, src, True, name, str(out), request, opts)
            except sqlite3.OperationalError as e:
                if "full" in str(e):
                    raise disk_full() from None
                raise
            except OSError as e:
                if e.errno in DISK_FULL:
                    raise disk_full() from None
                raise
        except BaseException:
            release(src)  # the job's own copy of its input: nothing else will ever read it
            raise
        return store.get(job_id)

    @api.get("/v1/jobs")
    def list_jobs(state: str | None = None, limit: int = 100):
        if state is not None and state not in STATES:
            raise bad(400, f"state must be one of {', '.join(STATES)}")
        if not 1 <= limit <= 1000:
            raise bad(400, "limit must be in 1..1000")
        jobs = store.list(state, limit)
        for j in jobs:
            if j.get("error"):
                j["error"] = mask(j["error"])
        return {"jobs": jobs}

    @api.get("/v1/jobs/{job_id}")
    def job_status(job_id: str):
        job = job_or_404(job_id)
        total = job["progress_total"]
        job["progress"] = job["progress_done"] / total if total else (1.0 if job["state"] == "done" else 0.0)
        return job

    @api.get("/v1/jobs/{job_id}/result")
    def job_result(job_id: str):
        job = job_or_404(job_id)
        if job["state"] != "done":
            raise bad(409, f"job is {job['state']}; the result exists once it is done")
        p = store.get(job_id, full=True)["output_path"]
        if not os.path.isfile(p):
            raise bad(410, "the result file is gone")
        return FileResponse(p, filename=f"{job_id}{Path(p).suffix}")

    @api.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str):
        before = job_or_404(job_id)["state"]
        state = store.cancel(job_id)
        if before == "queued" and state == "cancelled":  # it never runs: its own input goes now
            full = store.get(job_id, full=True)
            if full["input_owned"]:
                release(full["input_path"])
        return store.get(job_id) | {"state": state}

    return api


def _one(e: BaseException) -> str:
    return one_line(str(e), 300)
