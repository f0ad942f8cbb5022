"""The persistent job queue: one SQLite table (WAL), one row per job.

A job is a row before anyone is told it was accepted (``submit`` commits, then
returns). Statuses: queued -> running -> succeeded | failed | cancelled.

Ordering is FIFO with bounded affinity reordering: when the worker has model M with
adapters A set up, a queued job needing the same (M, A) may run before older jobs
that need something else, which saves a switch. Each time a job is passed over its
``overtaken`` count goes up; the head of the queue is never passed over more than
``max_overtake`` times, so no job waits behind more than that many later jobs.
Control jobs (model switch, preset apply/restore) change what later jobs run on,
so nothing is ever moved in front of one.
"""
from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from ..errors import JobNotFound, QueueFull, ShuttingDown, StoreError, StudioError

NUMBER = re.compile(r"#?([0-9]{1,12})")  # a job's number, as the UI shows it ("#12")
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")
# kinds that change the worker's state for every later job: never reordered around
BARRIER_KINDS = frozenset({"load_model", "apply_preset", "restore_base"})
KINDS = frozenset({"generate"}) | BARRIER_KINDS




def group_key(model: str | None, adapters: list[dict] | None, preset: str | None) -> str:
    """What a job needs set up on the device; equal keys run back to back without a switch."""
    parts = sorted((a.get("path") or a.get("name") or "", json.dumps(a.get("scale"), sort_keys=True))
                   for a in adapters or [])
    return json.dumps([model, preset, parts])


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT,
    params TEXT NOT NULL,
    adapters TEXT NOT NULL,
    preset TEXT,
    grp TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    result TEXT,
    error TEXT,
    error_detail TEXT,
    overtaken INTEGER NOT NULL DEFAULT 0,
    requeues INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    dispatch_no INTEGER,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status, seq);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner, status, seq);
"""
COLUMNS = tuple(line.split()[0] for line in SCHEMA.split("(", 1)[1].split(");", 1)[0].strip().splitlines())
# PRAGMA user_version of the store this code writes; 0 is a store from before versioning (same table).
# 2: ``owner`` (who submitted the job; backend/users.py), added to a version 0/1 store when it is opened
SCHEMA_VERSION = 2
ADDED_COLUMNS = {"owner": "TEXT"}  # columns a migration adds to an older store (its rows: no owner)
JSON_COLUMNS = ("params", "adapters", "result", "error_detail")



class JobQueue:
    def __init__(self, path: str | Path, *, max_queue: int = 256, max_overtake: int = 4):
        if max_queue < 1:
            raise StudioError(f"max_queue must be at least 1, got {max_queue}", param="max_queue")
        if max_overtake < 0:
            raise StudioError(f"max_overtake must be >= 0, got {max_overtake}", param="max_overtake")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_queue, self.max_overtake = max_queue, max_overtake
        self._db = _open(self.path)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._interrupted = False
        # waits from an event loop (HTTP handlers): job id -> {(loop, asyncio.Event)}, set when it ends
        self._async_waiters: dict[str, set] = {}

    def interrupt(self) -> None:
        """The server is shutting down: every ``wait`` ends now with ShuttingDown, so request
        handlers answer at once instead of being cancelled mid-wait by the HTTP server."""
        with self._changed:
            self._interrupted = True
            self._changed.notify_all()
        self._wake_async(None)

    def _wake_async(self, job_id: str | None) -> None:
        """Wake the event-loop waits on ``job_id`` (None: every one), from any thread."""
        with self._lock:
            entries = [e for k, group in self._async_waiters.items() if job_id is None or k == job_id
                       for e in group]
        for loop, event in entries:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its wait is gone too
                pass

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ----------------------------------------------------------------------------------
    def _tx(self):
        return _Tx(self)

    def submit(self, kind: str, *, model: str | None, params: dict, adapters: list[dict] | None = None,
               preset: str | None = None) -> dict:
        return self.submit_many([{"kind": kind, "model": model, "params": params, "adapters": adapters,
                                  "preset": preset}])[0]

    def submit_many(self, jobs: list[dict]) -> list[dict]:
        """Queue several jobs (each {"kind", "model", "params", "adapters", "preset"}, and "owner": who
        submitted it, or None) in one transaction:
        all of them, in order, or none (QueueFull when they do not all fit under --max-queue)."""
        rows = []
        for job in jobs:
            if job["kind"] not in KINDS:
                raise StudioError(f"unknown job kind {job['kind']!r}; one of {', '.join(sorted(KINDS))}",
                                  param="kind")
            adapters = list(job.get("adapters") or [])
            rows.append((uuid.uuid4().hex[:16], job["kind"], job.get("model"), json.dumps(job["params"]),
                         json.dumps(adapters), job.get("preset"),
                         group_key(job.get("model"), adapters, job.get("preset")), job.get("owner")))
        with self._tx() as db:
            depth = db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued'").fetchone()[0]
            if depth + len(rows) > self.max_queue:
                more = f"; these {len(rows)} jobs do not all fit" if len(rows) > 1 else ""
                raise QueueFull(f"the job queue is full ({depth} queued, --max-queue {self.max_queue}{more}); "
                                "retry later")
            now = time.time()
            db.executemany("INSERT INTO jobs (id, kind, status, model, params, adapters, preset, grp, owner, "
                           "created_at) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?)", [(*row, now) for row in rows])
        return [self.get(row[0]) for row in rows]

    def claim(self, current_group: str | None) -> dict | None:
        """Mark the next job running (see the module docstring for the order) and return it.
        A row that cannot be read (invalid JSON) is marked failed on the way and skipped."""
        for _ in range(10_000):
            job = self._claim_one(current_group)
            if job is None or job["status"] == "running":
                return job
        return None

    def _claim_one(self, current_group: str | None) -> dict | None:
        with self._tx() as db:
            rows = db.execute("SELECT seq, id, kind, grp, overtaken FROM jobs WHERE status='queued' "
                              "ORDER BY seq").fetchall()
            if not rows:
                return None
            pick = rows[0]
            if pick["overtaken"] < self.max_overtake and pick["kind"] not in BARRIER_KINDS \
                    and current_group is not None and pick["grp"] != current_group:
                for row in rows[1:]:
                    if row["kind"] in BARRIER_KINDS:
                        break
                    if row["grp"] == current_group:
                        pick = row
                        break
            if pick["seq"] != rows[0]["seq"]:
                db.execute("UPDATE jobs SET overtaken = overtaken + 1 WHERE status='queued' AND seq < ?",
                           (pick["seq"],))
            number = db.execute("SELECT COALESCE(MAX(dispatch_no), 0) + 1 FROM jobs").fetchone()[0]
            db.execute("UPDATE jobs SET status='running', started_at=?, step=0, total=0, dispatch_no=? "
                       "WHERE seq=?", (time.time(), number, pick["seq"]))
        return self.get(pick["id"])

    def claim_compatible(self, key_of, key: str, limit: int) -> list[dict]:
        """Mark up to ``limit`` more queued generate jobs with ``key_of(model, preset, params) == key`` running
        (a mixed-adapter batch with the job just claimed) and return them. Scanned in seq order, never past a
        control job, nor past a job already passed over ``max_overtake`` times; each job passed over by a
        picked one has its ``overtaken`` count raised, as the affinity order does."""
        if limit < 1:
            return []
        with self._tx() as db:
            rows = db.execute("SELECT seq, id, kind, model, params, preset, overtaken FROM jobs "
                              "WHERE status='queued' ORDER BY seq").fetchall()
            picked, passed = [], []
            for row in rows:
                if len(picked) >= limit or row["kind"] in BARRIER_KINDS:
                    break
                try:
                    params = json.loads(row["params"])
                except (TypeError, ValueError):
                    params = None
                if isinstance(params, dict) and row["kind"] == "generate" and \
                        key_of(row["model"], row["preset"], params) == key:
                    picked.append(row)
                    continue
                if row["overtaken"] >= self.max_overtake:
                    break
                passed.append(row)
            if not picked:
                return []
            last = picked[-1]["seq"]
            for row in passed:
                if row["seq"] < last:
                    db.execute("UPDATE jobs SET overtaken = overtaken + 1 WHERE seq=?", (row["seq"],))
            number = db.execute("SELECT COALESCE(MAX(dispatch_no), 0) + 1 FROM jobs").fetchone()[0]
            for k, row in enumerate(picked):
                db.execute("UPDATE jobs SET status='running', started_at=?, step=0, total=0, dispatch_no=? "
                           "WHERE seq=?", (time.time(), number + k, row["seq"]))
        return [self.get(row["id"]) for row in picked]

    def progress(self, job_id: str, step: int, total: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET step=?, total=? WHERE id=? AND status='running'", (step, total, job_id))

    def finish(self, job_id: str, status: str, *, result: dict | None = None, error: str | None = None,
               error_detail: dict | None = None) -> dict:
        """Record the end of a running job. ``result`` names files that are already durable;
        ``error_detail`` is the ``to_wire()`` of the StudioError that failed it, less its message."""
        if status not in FINISHED:
            raise ValueError(f"finish() takes one of {FINISHED}, got {status!r}")
        with self._tx() as db:
            db.execute("UPDATE jobs SET status=?, finished_at=?, result=?, error=?, error_detail=? "
                       "WHERE id=? AND status='running'",
                       (status, time.time(), json.dumps(result) if result is not None else None, error,
                        json.dumps(error_detail) if error_detail else None, job_id))
        self._wake_async(job_id)
        return self.get(job_id)

    def fail(self, job_id: str, error: StudioError) -> dict:
        """``finish`` as failed by ``error``: its message, and the rest of its ``to_wire()`` as detail."""
        wire = error.to_wire()
        return self.finish(job_id, "failed", error=wire.pop("message"), error_detail=wire)

    def cancel(self, job_id: str) -> tuple[dict, bool]:
        """Cancel a queued job now; flag a running one. Returns (job, is_running)."""
        with self._tx() as db:
            row = self._row(db, job_id)
            job_id = row["id"]
            if row["status"] == "queued":
                db.execute("UPDATE jobs SET status='cancelled', finished_at=?, error=? WHERE id=?",
                           (time.time(), "cancelled while queued", job_id))
            elif row["status"] == "running":
                db.execute("UPDATE jobs SET cancel_requested=1 WHERE id=?", (job_id,))
        self._wake_async(job_id)
        job = self.get(job_id)
        return job, job["status"] == "running"

    def cancel_requested(self, job_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT cancel_requested FROM jobs WHERE id=?", (job_id,)).fetchone()
        return bool(row and row[0])

    def recover(self) -> dict:
        """After a server restart: jobs left 'running' are re-queued once, then failed. Unfinished
        rows that cannot be read (invalid JSON) are marked failed with the reason (counted in "failed")."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE status IN ('queued', 'running')").fetchall()
            bad = sum(1 for row in rows if self._to_dict(row)["status"] == "failed")
        with self._tx() as db:
            rows = db.execute("SELECT id, requeues FROM jobs WHERE status='running'").fetchall()
            requeued = failed = 0
            for row in rows:
                if row["requeues"] < 1:
                    db.execute("UPDATE jobs SET status='queued', requeues=requeues+1, step=0, total=0, "
                               "started_at=NULL WHERE id=?", (row["id"],))
                    requeued += 1
                else:
                    db.execute("UPDATE jobs SET status='failed', finished_at=?, error=? WHERE id=?",
                               (time.time(), "interrupted by a server restart twice; not retried again",
                                row["id"]))
                    failed += 1
        return {"requeued": requeued, "failed": failed + bad}

    # -- reads -----------------------------------------------------------------------------------
    def get(self, job_id: str) -> dict:
        with self._lock:
            return self._to_dict(self._row(self._db, job_id))

    def list(self, limit: int = 100, status: str | None = None, *, owner: str | None = None) -> list[dict]:
        """The newest ``limit`` jobs (of a ``status``; with ``owner``, only that owner's)."""
        if status is not None and status not in STATUSES:
            raise StudioError(f"unknown status {status!r}; one of {', '.join(STATUSES)}", param="status")
        where, args = [], []
        if status:
            where.append("status=?")
            args.append(status)
        if owner is not None:
            where.append("owner=?")
            args.append(owner)
        sql = "SELECT * FROM jobs" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY seq DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit)).fetchall()
            return [self._to_dict(r) for r in rows]

    def counts(self) -> dict:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        out = {s: 0 for s in STATUSES}
        out.update({r[0]: r[1] for r in rows})
        return out

    def scheduler_stats(self) -> dict:
        """Setup switches in the order jobs actually ran vs the FIFO order of the same jobs."""
        with self._lock:
            rows = self._db.execute("SELECT seq, dispatch_no, grp, overtaken FROM jobs "
                                    "WHERE dispatch_no IS NOT NULL").fetchall()
        ran = [r["grp"] for r in sorted(rows, key=lambda r: r["dispatch_no"])]
        fifo = [r["grp"] for r in sorted(rows, key=lambda r: r["seq"])]
        actual, plain = _switches(ran), _switches(fifo)
        return {"dispatched": len(rows), "switches": actual, "fifo_switches": plain,
                "switches_saved": plain - actual, "max_overtake": self.max_overtake,
                "max_overtaken_seen": max((r["overtaken"] for r in rows), default=0)}

    def upcoming(self, limit: int) -> list[dict]:
        """The next queued generate jobs (seq order, up to a control job, which may change the model),
        each {"id", "grp", "model", "adapters"}; for prefetching their adapters (backend/jobs/prefetch.py)."""
        out = []
        with self._lock:
            rows = self._db.execute("SELECT id, kind, grp, model, adapters FROM jobs WHERE status='queued' "
                                    "ORDER BY seq").fetchall()
        for row in rows:
            if len(out) >= limit or row["kind"] in BARRIER_KINDS:
                break
            out.append({"id": row["id"], "grp": row["grp"], "model": row["model"],
                        "adapters": json.loads(row["adapters"])})
        return out

    def count_queued(self, grp: str) -> int:
        """Queued jobs with this setup (``group_key``): the affinity order runs them back to back."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued' AND grp=?",
                                    (grp,)).fetchone()[0]

    def wait(self, job_id: str, timeout: float | None = None) -> dict:
        """Block until the job is finished (or the timeout passes); returns its dict. Raises
        ShuttingDown once ``interrupt()`` was called and the job is still unfinished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                job, left = self._settled(self.get(job_id), deadline)
                if job is not None:
                    return job
                self._changed.wait(timeout=0.5 if left is None else min(left, 0.5))

    async def wait_async(self, job_id: str, timeout: float | None = None) -> dict:
        """``wait`` for an event loop: holds no thread while the job runs (an HTTP server has a few
        dozen), only for the short read of the row each time it may have ended."""
        from starlette.concurrency import run_in_threadpool

        loop = asyncio.get_running_loop()
        entry = (loop, asyncio.Event())
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._async_waiters.setdefault(job_id, set()).add(entry)
        try:
            while True:
                entry[1].clear()
                job, left = self._settled(await run_in_threadpool(self.get, job_id), deadline)
                if job is not None:
                    return job
                try:  # woken when the job ends; the timeout only re-checks (e.g. a row changed elsewhere)
                    await asyncio.wait_for(entry[1].wait(), 5.0 if left is None else min(left, 5.0))
                except asyncio.TimeoutError:
                    pass
        finally:
            with self._lock:
                group = self._async_waiters.get(job_id)
                if group is not None:
                    group.discard(entry)
                    if not group:
                        del self._async_waiters[job_id]

    # -- helpers ---------------------------------------------------------------------------------
    def _settled(self, job: dict, deadline: float | None) -> tuple[dict | None, float | None]:
        """One step of a wait: (the job, None) when it is finished or the deadline has passed,
        else (None, seconds left or None); ShuttingDown once ``interrupt()`` was called."""
        if job["status"] in FINISHED:
            return job, None
        if self._interrupted:
            raise ShuttingDown(f"the server is shutting down; job {job['id']} is kept in the queue and runs "
                               "when the server starts again", param="job_id")
        left = None if deadline is None else deadline - time.monotonic()
        return (job, None) if left is not None and left <= 0 else (None, left)

    @staticmethod
    def _row(db, job_id: str):
        """A job's row by its id, or by its number (``12`` or ``#12``: the row's ``seq``, what the UI shows;
        an id is 16 hex digits, so the two never meet)."""
        number = NUMBER.fullmatch(str(job_id))
        if number:
            row = db.execute("SELECT * FROM jobs WHERE seq=?", (int(number.group(1)),)).fetchone()
        else:
            row = db.execute("SELECT * FROM jobs WHERE id=?", (str(job_id),)).fetchone()
        if row is None:
            raise not_found(job_id)
        return row

    def _to_dict(self, row) -> dict:
        decoded, bad = {}, []
        for column in JSON_COLUMNS:
            try:
                decoded[column] = json.loads(row[column]) if row[column] else None
            except (TypeError, ValueError) as exc:
                decoded[column] = None
                bad.append(f"{column} ({exc})")
        status, error, finished_at = row["status"], row["error"], row["finished_at"]
        if bad:  # a damaged row: failed with the reason, never left queued or running for ever
            reason = f"the stored {', '.join(bad)} of this job in {self.path.name} is not valid JSON"
            if status not in FINISHED:
                status, error, finished_at = "failed", reason, time.time()
                self._db.execute("UPDATE jobs SET status='failed', finished_at=?, error=?, error_detail=NULL "
                                 "WHERE seq=? AND status IN ('queued', 'running')", (finished_at, error, row["seq"]))
                self._changed.notify_all()
                self._wake_async(row["id"])
            else:
                error = error or reason
        position = None
        if status == "queued":
            position = self._db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued' AND seq <= ?",
                                        (row["seq"],)).fetchone()[0]
        return {
            "id": row["id"], "number": row["seq"], "kind": row["kind"], "status": status,
            "progress": {"step": row["step"], "total": row["total"]}, "queue_position": position,
            "model": row["model"], "params": decoded["params"] if isinstance(decoded["params"], dict) else {},
            "adapters": decoded["adapters"] if isinstance(decoded["adapters"], list) else [],
            "preset": row["preset"], "created_at": row["created_at"], "started_at": row["started_at"],
            "finished_at": finished_at, "result": decoded["result"], "error": error,
            "error_detail": decoded["error_detail"], "overtaken": row["overtaken"], "requeues": row["requeues"],
            "owner": row["owner"],
        }


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT under the queue's lock; waiters are woken on commit."""

    def __init__(self, queue: JobQueue):
        self.q = queue

    def __enter__(self):
        self.q._lock.acquire()
        self.q._db.execute("BEGIN IMMEDIATE")
        return self.q._db

    def __exit__(self, exc_type, exc, tb):
        try:
            self.q._db.execute("ROLLBACK" if exc_type else "COMMIT")
            if exc_type is None:
                self.q._changed.notify_all()
        finally:
            self.q._lock.release()
        return False


def _open(path: Path) -> sqlite3.Connection:
    """Open (or create) the store; a damaged or newer one stops here with one line naming the file."""
    aside = (f"move it aside (`mv {path} {path}.bad`, with any {path.name}-wal and {path.name}-shm beside it) "
             "and start again: a new, empty queue is created and the old file stays for you to inspect")
    db = None
    try:
        db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        db.row_factory = sqlite3.Row
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in range(SCHEMA_VERSION + 1):
            raise StoreError(f"the job store {path} has schema version {version}, which this LoRA Studio does not "
                             f"know (it reads versions up to {SCHEMA_VERSION}): run the LoRA Studio that wrote it, "
                             f"or {aside}", param="data_dir")
        # a table from an older layout (columns missing) is refused as it is: never altered, never stamped
        have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        missing = [c for c in COLUMNS if c not in have and c not in ADDED_COLUMNS] if have else []
        if missing:
            raise StoreError(f"the job store {path} is from an older LoRA Studio (schema version {version}, its jobs "
                             f"table has no {', '.join(missing)}), which this one cannot read; {aside}",
                             param="data_dir")
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: an accepted job survives a power cut, not only a process crash
        db.execute("PRAGMA synchronous=FULL")
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise StoreError(f"the job store {path} is damaged (SQLite: {check}); {aside}", param="data_dir")
        for column, kind in ADDED_COLUMNS.items():
            if have and column not in have:  # an older store, readable: migrated, its jobs owned by no one
                db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        db.executescript(SCHEMA)
        if version < SCHEMA_VERSION:
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return db
    except sqlite3.DatabaseError as exc:
        if db is not None:
            db.close()
        raise StoreError(f"the job store {path} is not a usable SQLite database ({exc}); {aside}",
                         param="data_dir") from None
    except StoreError:
        db.close()
        raise


def not_found(job_id) -> JobNotFound:
    """What an unknown job id gets (and, word for word, a job the asker may not see: backend/users.py)."""
    return JobNotFound(f"no job with id {job_id!r}", param="job_id")


def _switches(groups: list[str]) -> int:
    return sum(1 for a, b in zip(groups, groups[1:]) if a != b)
