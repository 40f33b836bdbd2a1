"""The run's results: one JSON document and its Markdown tables, rewritten atomically after every row.

A step is ``running`` while it runs (with its start and budget, so the watching parent can cut it
off), then ``ok``, ``failed`` (a row failed or the step raised), ``timed out`` (cut off at its
budget), ``crashed`` (its process died) or ``skipped`` (not run, with the reason). A row is one
measurement or check with a ``result``: ``ok``, ``FAIL`` (with ``why``) or ``skip`` (with ``why``).
The two files are replaced whole (written beside, then renamed), so a reader never sees half a file,
whatever killed the run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

JSON, MARKDOWN = "results.json", "results.md"
FINAL = ("ok", "failed", "timed out", "crashed", "skipped")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Report:
    """``results.json`` and ``results.md`` of one run directory; every change is written at once."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / JSON
        self.data = json.loads(path.read_text()) if path.exists() else {"run": {}, "steps": []}

    # -- reading --------------------------------------------------------------------------------

    def step(self, name: str) -> dict | None:
        return next((s for s in self.data["steps"] if s["name"] == name), None)

    def done(self, name: str) -> bool:
        s = self.step(name)
        return s is not None and s["status"] in FINAL

    def running(self) -> dict | None:
        """The step that is running now (name, started, budget_s), or None."""
        return next((s for s in self.data["steps"] if s["status"] == "running"), None)

    def failures(self) -> list[str]:
        """One line per failed row or step that did not finish (what a run found wrong)."""
        out = []
        for s in self.data["steps"]:
            if s["status"] in ("timed out", "crashed"):
                out.append(f"{s['name']}: {s['status']}: {s.get('error', '')}")
            elif s["status"] == "failed" and s.get("error"):
                out.append(f"{s['name']}: {s['error']}")
            out += [f"{s['name']}: {r.get('item', '')}: {r.get('why', '')}" for r in s["rows"] if r["result"] == "FAIL"]
        return out

    # -- writing --------------------------------------------------------------------------------

    def run(self, **fields) -> None:
        """Facts about the whole run (device, versions, ceilings, profile)."""
        self.data["run"].update(fields)
        self.write()

    def begin(self, name: str, title: str, budget_s: float) -> None:
        s = self.step(name)
        if s is None:
            s = {"name": name}
            self.data["steps"].append(s)
        s.update(title=title, status="running", started=time.time(), budget_s=round(budget_s, 1), seconds=None,
                 rows=[], notes=[], error=None)
        self.write()

    def row(self, name: str, result: str = "ok", why: str | None = None, **fields) -> dict:
        """Add one row to step ``name``; ``result`` ok / FAIL / skip."""
        if result not in ("ok", "FAIL", "skip"):
            raise ValueError(f"a row's result is ok, FAIL or skip, got {result!r}")
        row = {"result": result, **({"why": why} if why else {}), **fields}
        self.step(name)["rows"].append(row)
        self.write()
        return row

    def note(self, name: str, text: str) -> None:
        self.step(name)["notes"].append(text)
        self.write()

    def end(self, name: str, status: str | None = None, error: str | None = None) -> None:
        """Close step ``name``: ``status`` given, else failed when a row failed, else ok."""
        s = self.step(name)
        if s is None:  # closed without having begun (skipped before it started)
            s = {"name": name, "title": name, "started": None, "budget_s": None, "rows": [], "notes": []}
            self.data["steps"].append(s)
        if status is None:
            status = "failed" if error or any(r["result"] == "FAIL" for r in s["rows"]) else "ok"
        if status not in FINAL:
            raise ValueError(f"a step ends as one of {FINAL}, got {status!r}")
        s["status"], s["error"] = status, error
        s["seconds"] = round(time.time() - s["started"], 1) if s.get("started") else None
        self.write()

    def write(self) -> None:
        _atomic_write(self.dir / JSON, json.dumps(self.data, indent=1, default=str) + "\n")
        _atomic_write(self.dir / MARKDOWN, markdown(self.data))


# -- Markdown ------------------------------------------------------------------------------------


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, (list, tuple)):
        return "x".join(str(x) for x in v) if all(isinstance(x, int) for x in v) else ", ".join(map(str, v))
    return str(v).replace("|", "/").replace("\n", " ")


def _groups(rows: list[dict]) -> list[list[dict]]:
    """Consecutive rows with the same fields (results aside) share a table."""
    out: list[list[dict]] = []
    for r in rows:
        keys = [k for k in r if k not in ("result", "why")]
        if out and [k for k in out[-1][0] if k not in ("result", "why")] == keys:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _table(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k not in ("result", "why")]
    cols = cols + ["result", "why"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def markdown(data: dict) -> str:
    run = data.get("run", {})
    out = [f"# GPU check: {run.get('device', '?')}, {run.get('date', '?')}", ""]
    facts = {k: v for k, v in run.items() if k not in ("device", "date") and not isinstance(v, dict)}
    out += [f"- {k}: {_cell(v)}" for k, v in facts.items()]
    for k, v in run.items():
        if isinstance(v, dict):
            out.append(f"- {k}: " + ", ".join(f"{a} {_cell(b)}" for a, b in v.items()))
    out += ["", "| step | status | seconds | budget s | host CPU s | failed rows |", "| --- | --- | --- | --- | --- | --- |"]
    for s in data["steps"]:
        bad = sum(r["result"] == "FAIL" for r in s["rows"])
        out.append(f"| {s['name']} | {s['status']} | {_cell(s.get('seconds'))} | {_cell(s.get('budget_s'))} "
                   f"| {_cell(s.get('cpu_s'))} | {bad} |")
    for s in data["steps"]:
        out += ["", f"## {s['name']}: {s.get('title', '')}", "", f"Status: **{s['status']}**"
                + (f": {s['error']}" if s.get("error") else "")]
        out += [f"- {n}" for n in s.get("notes", [])]
        for group in _groups(s["rows"]):
            out += [""] + _table(group)
    return "\n".join(out) + "\n"
