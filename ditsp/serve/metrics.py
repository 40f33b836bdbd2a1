"""Prometheus metrics of one server (its own registry, so several servers in one process do not clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..models.seedvr2.job.restore import STAGES
import time

_LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))
_REBUILD_PARTS = ("form", "weights", "replan", "total")


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, store, controller_status=None):
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("ditsp_queue_depth", "jobs waiting in the queue", registry=r)
        self.queue_depth.set_function(lambda: store.count("queued"))
        self.running = Gauge("ditsp_jobs_running", "jobs running now", registry=r)
        self.running.set_function(lambda: store.count("running"))
        self.ranks = Gauge("ditsp_ranks", "ranks in the serving SP group", registry=r)
        self.jobs = Counter("ditsp_jobs_finished", "jobs finished, by final state", ["state"], registry=r)
        self.latency = Histogram("ditsp_job_latency_seconds", "submission to completion", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.run_time = Histogram("ditsp_job_run_seconds", "time on the group (last attempt)",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.stage = Counter("ditsp_stage_seconds", "time per pipeline stage (rank 0), summed over jobs", ["stage"],
                             registry=r)
        self.reconfigs = Counter("ditsp_reconfigurations", "SP group rebuilds, by reason", ["reason"], registry=r)
        self.rebuild = Gauge("ditsp_last_rebuild_seconds", "parts of the last group rebuild", ["part"], registry=r)
        for s in STAGES:
            self.stage.labels(s)
        for p in _REBUILD_PARTS:
            self.rebuild.labels(p)

    def job_done(self, job: dict, summary: dict | None, run_s: float, state: str) -> None:
        self.jobs.labels(state).inc()
        self.latency.observe(max(0.0, time.time() - job["created"]))
        self.run_time.observe(run_s)
        if summary:
            for s, t in summary.get("stage_s", {}).items():
                self.stage.labels(s).inc(t)

    def reconfigured(self, rec, ranks: int) -> None:
        self.ranks.set(ranks)
        self.reconfigs.labels(rec.reason).inc()
        for p, v in (("form", rec.form_s), ("weights", rec.weights_s), ("replan", rec.replan_s),
                     ("total", rec.total_s)):
            self.rebuild.labels(p).set(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)
