"""Jobs and their state in SQLite under the server's data dir; inputs and results as files beside it.

Layout of a data dir::

    lock               held (flock) by the one server using the data dir; it names that server's pid
    jobs.sqlite        one row per job (WAL mode; every change is one committed transaction)
    uploads/<id><ext>  uploaded inputs (the client's file name is never used as a path)
    results/<id><ext>  restored outputs

States: ``queued`` -> ``running`` -> ``done`` | ``failed`` | ``cancelled``.
A job is accepted once its row is committed, so a server that stops loses
none: on start, :meth:`JobStore.recover` puts ``running`` jobs whose owner is
gone back in the queue (they re-run from the start, into the same output path)
and queued jobs wait their turn. One server per data dir: the store holds an
exclusive lock on ``lock`` for its lifetime, so a second server is refused
with a clear message instead of taking the first one's jobs. Jobs are claimed in submission order by an idle group
(:meth:`claim_next`: pull-based).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sqlite3
import stat
import threading
import time
import uuid
from pathlib import Path
from ..io.write import sweep_temps

STATES = ("queued", "running", "done", "failed", "cancelled")
FINAL = ("done", "failed", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    state TEXT NOT NULL,
    input_path TEXT NOT NULL,
    input_owned INTEGER NOT NULL,
    input_name TEXT,
    output_path TEXT NOT NULL,
    request TEXT NOT NULL,
    options TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    progress_done INTEGER NOT NULL DEFAULT 0,
    progress_total INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    world_size INTEGER,
    owner TEXT,
    report TEXT,
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
"""

_PUBLIC = ("id", "state", "input_name", "created", "started", "finished", "attempts", "progress_done",
           "progress_total", "cancel_requested", "world_size", "error", "options")


def new_id() -> str:
    return uuid.uuid4().hex


class DataDirError(ValueError):
    """The data dir cannot be used (unsafe mode, another server holds it, not a folder)."""


def prepare_dir(path: Path) -> None:
    """Create ``path`` with mode 0700, or check an existing one; never change an existing folder's mode.

    A folder others can write to is refused: they could swap the job database,
    plant results or read uploads. ``uploads/`` and ``results/`` are created
    0700 inside it.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask; this folder is new and ours
        return
    except FileExistsError:
        pass
    except OSError as e:
        raise DataDirError(f"--data-dir {path}: cannot create it ({e.strerror})") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise DataDirError(f"--data-dir {path}: exists and is not a folder")
    if st.st_uid != os.getuid():
        raise DataDirError(f"--data-dir {path}: owned by another user (uid {st.st_uid}); use a folder of your own")
    if st.st_mode & 0o022:
        raise DataDirError(f"--data-dir {path}: is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o});"
                           f" use a new folder (created 0700) or chmod go-w it yourself")


def _take_lock(root: Path) -> int:
    """An exclusive, non-blocking flock on ``root/lock``; it holds the owner's pid. Released when the fd closes."""
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise DataDirError(f"--data-dir {root}: in use by another ditsp serve ({other}); "
                               f"one server per data dir (stop it, or give this one another --data-dir)") from None
        raise DataDirError(f"--data-dir {root}: cannot lock it ({e.strerror})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


class JobStore:
    """The job table of one data dir (thread-safe: one connection behind a lock)."""

    def __init__(self, data_dir: str | os.PathLike):
        self.root = Path(os.path.abspath(data_dir))
        self.uploads = self.root / "uploads"
        self.results = self.root / "results"
        prepare_dir(self.root)
        self._lock_fd = _take_lock(self.root)
        try:
            for d in (self.uploads, self.results):
                prepare_dir(d)

            sweep_temps(self.results)  # half-written results of a server that was killed
            # this server's name in the rows it claims: a restart re-queues only jobs of owners that are gone
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
            self._lock = threading.Lock()
            self._db = sqlite3.connect(self.root / "jobs.sqlite", check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
                cols = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
                if "owner" not in cols:  # a data dir from before owners were recorded
                    self._db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT")
        except BaseException:
            os.close(self._lock_fd)
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _exec(self, sql: str, args=()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- writes ---------------------------------------------------------------

    def add(self, job_id: str, input_path: str, input_owned: bool, input_name: str | None, output_path: str,
            request: dict, options: dict) -> None:
        self._exec(
            "INSERT INTO jobs (id, state, input_path, input_owned, input_name, output_path, request, options, created)"
            " VALUES (?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
            (job_id, input_path, int(input_owned), input_name, output_path, json.dumps(request), json.dumps(options),
             time.time()))

    def recover(self) -> int:
        """Put jobs a stopped server left running back in the queue; returns how many.

        Only jobs of other owners: this store holds the data dir's lock, so
        their server is gone (a live one would still hold it).
        """
        with self._lock:
            cur = self._db.execute("UPDATE jobs SET state='queued', progress_done=0, owner=NULL "
                                   "WHERE state='running' AND (owner IS NULL OR owner != ?)", (self.owner,))
            return cur.rowcount

    def claim_next(self) -> dict | None:
        """The oldest queued job, now running (atomic), or None."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT * FROM jobs WHERE state='queued' ORDER BY seq LIMIT 1").fetchone()
                if row is None:
                    self._db.execute("COMMIT")
                    return None
                self._db.execute("UPDATE jobs SET state='running', started=?, attempts=attempts+1, progress_done=0, "
                                 "owner=? WHERE id=?", (time.time(), self.owner, row["id"]))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self.get(row["id"], full=True)

    def requeue(self, job_id: str) -> None:
        """A running job whose group broke: back to the head of the queue (it keeps its place)."""
        self._exec("UPDATE jobs SET state='queued', progress_done=0 WHERE id=? AND state='running'", (job_id,))

    def progress(self, job_id: str, done: int, total: int) -> None:
        self._exec("UPDATE jobs SET progress_done=?, progress_total=? WHERE id=? AND state='running'",
                   (done, total, job_id))

    def finish(self, job_id: str, state: str, report: dict | None = None, error: str | None = None,
               world_size: int | None = None) -> None:
        if state not in FINAL:
            raise ValueError(f"not a final state: {state}")
        self._exec("UPDATE jobs SET state=?, finished=?, report=?, error=?, world_size=COALESCE(?, world_size),"
                   " progress_done=CASE WHEN ?='done' THEN progress_total ELSE progress_done END WHERE id=?",
                   (state, time.time(), json.dumps(report) if report is not None else None, error, world_size,
                    state, job_id))

    def cancel(self, job_id: str) -> str | None:
        """Cancel a queued job at once, or ask a running one to stop; the job's state after, None if unknown."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                self._db.execute("COMMIT")
                return None
            if row["state"] == "queued":
                self._db.execute("UPDATE jobs SET state='cancelled', finished=? WHERE id=?", (time.time(), job_id))
            elif row["state"] == "running":
                self._db.execute("UPDATE jobs SET cancel_requested=1 WHERE id=?", (job_id,))
            self._db.execute("COMMIT")
        return self._exec("SELECT state FROM jobs WHERE id=?", (job_id,))[0]["state"]

    # -- reads ----------------------------------------------------------------

    def get(self, job_id: str, full: bool = False) -> dict | None:
        rows = self._exec("SELECT * FROM jobs WHERE id=?", (job_id,))
        return self._row(rows[0], full) if rows else None

    def list(self, state: str | None = None, limit: int = 100) -> list[dict]:
        if state:
            rows = self._exec("SELECT * FROM jobs WHERE state=? ORDER BY seq DESC LIMIT ?", (state, limit))
        else:
            rows = self._exec("SELECT * FROM jobs ORDER BY seq DESC LIMIT ?", (limit,))
        return [self._row(r, False) for r in rows]

    def expired(self, before: float) -> list[dict]:
        """Finished jobs (full rows) that ended before ``before`` (a time.time())."""
        rows = self._exec("SELECT * FROM jobs WHERE state IN ('done', 'failed', 'cancelled') AND finished < ?",
                          (before,))
        return [self._row(r, True) for r in rows]

    def count(self, state: str) -> int:
        return self._exec("SELECT COUNT(*) AS n FROM jobs WHERE state=?", (state,))[0]["n"]

    def cancel_requested(self, job_id: str) -> bool:
        rows = self._exec("SELECT cancel_requested FROM jobs WHERE id=?", (job_id,))
        return bool(rows and rows[0]["cancel_requested"])

    @staticmethod
    def _row(row: sqlite3.Row, full: bool) -> dict:
        d = dict(row)
        d["options"] = json.loads(d["options"])
        d["report"] = json.loads(d["report"]) if d.get("report") else None
        d["cancel_requested"] = bool(d["cancel_requested"])
        if full:
            d["request"] = json.loads(d["request"])
            return d
        public = {k: d[k] for k in _PUBLIC}
        public["report"] = d["report"]
        public["has_result"] = d["state"] == "done"
        return public
