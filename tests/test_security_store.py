"""Issue 14 item 13, against a real `app.py serve`: a damaged job row is failed with its reason (and
/v1/jobs keeps answering), a corrupt or newer store stops the start with one line naming the file."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backend.api.server import free_port
from backend.jobs.queue import SCHEMA, SCHEMA_VERSION
from ui_fixtures import app_home, served_app

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo:qwen-image"
# the jobs table as schema version 1 wrote it (before ``owner``)
V1_SCHEMA = SCHEMA.replace(",\n    owner TEXT\n", "\n").replace(
    "CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner, status, seq);\n", "")
assert "owner" not in V1_SCHEMA


def _bad_row(db: Path, job_id: str, status: str, **columns) -> None:
    row = {"id": job_id, "kind": "generate", "status": status, "model": MODEL, "params": json.dumps({"prompt": "x"}),
           "adapters": "[]", "grp": "g", "created_at": time.time(), **columns}
    with sqlite3.connect(db) as conn:
        conn.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))


@pytest.fixture(scope="module")
def server(data_dir, demo_path, tmp_path_factory):
    """A store from before schema versions (user_version 0, the version-1 table: no ``owner``) holding two
    damaged unfinished rows."""
    demo_path(MODEL)
    home = app_home(data_dir, tmp_path_factory, "store")
    db = home / "jobs.sqlite"
    with sqlite3.connect(db) as conn:
        conn.executescript(V1_SCHEMA)
    _bad_row(db, "badrunning00", "running", params="{not json")
    _bad_row(db, "badqueued000", "queued", adapters="[oops")
    with served_app(home, env={"OMP_NUM_THREADS": "1"}) as served:
        yield served.url, db


def _job(url, job_id) -> dict:
    r = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_damaged_rows_at_start_are_failed_with_the_reason(server):
    url, db = server
    r = httpx.get(f"{url}/v1/jobs", timeout=30)
    assert r.status_code == 200, r.text[:300]
    for job_id, column in (("badrunning00", "params"), ("badqueued000", "adapters")):
        job = _job(url, job_id)
        assert job["status"] == "failed" and column in job["error"] and "not valid JSON" in job["error"], job
    with sqlite3.connect(db) as conn:
        # an old store is migrated (owner added, its jobs owned by no one) and stamped, not refused
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        assert "owner" in [r[1] for r in conn.execute("PRAGMA table_info(jobs)")]
        assert conn.execute("SELECT owner FROM jobs WHERE id='badrunning00'").fetchone() == (None,)


def test_a_row_damaged_while_serving_is_failed_and_the_queue_goes_on(server):
    url, db = server
    _bad_row(db, "badlater0000", "queued", params="{\"prompt\": ")
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "after", "num_inference_steps": 1}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    job = _job(url, "badlater0000")
    assert job["status"] == "failed" and "params" in job["error"], job
    r = httpx.get(f"{url}/v1/jobs", timeout=30)
    assert r.status_code == 200 and any(j["id"] == "badlater0000" for j in r.json()["data"])


def _start(home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app.py", "serve", MODEL, "--port", str(free_port()), "--device", "cpu",
                           "--data-dir", str(home)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LORA_STUDIO_HOME": str(home)})


def test_a_corrupt_store_stops_the_start_with_one_line_naming_the_file(data_dir, tmp_path_factory):
    home = app_home(data_dir, tmp_path_factory, "corrupt")
    db = home / "jobs.sqlite"
    garbage = b"this is not a database" * 200
    db.write_bytes(garbage)
    r = _start(home)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1, r.stderr
    assert str(db) in r.stderr and "move it aside" in r.stderr, r.stderr
    assert db.read_bytes() == garbage  # nothing deleted or rewritten


def test_a_store_from_a_newer_version_is_refused(data_dir, tmp_path_factory):
    home = app_home(data_dir, tmp_path_factory, "newer")
    db = home / "jobs.sqlite"
    with sqlite3.connect(db) as conn:
        conn.executescript(SCHEMA)
        conn.execute("PRAGMA user_version=99")
    r = _start(home)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and str(db) in r.stderr and "schema version 99" in r.stderr, r.stderr


def test_a_store_from_an_older_layout_gets_the_one_line_exit_and_is_not_relabelled(data_dir, tmp_path_factory):
    """Issue 25.7: a store without a schema version whose jobs table lacks columns crashed the start with a
    traceback (exit 1), after stamping it version 1."""
    home = app_home(data_dir, tmp_path_factory, "older")
    db = home / "jobs.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, "
                     "kind TEXT NOT NULL, status TEXT NOT NULL, params TEXT NOT NULL, created_at REAL NOT NULL)")
        conn.execute("INSERT INTO jobs (id, kind, status, params, created_at) VALUES "
                     "('oldjob000000', 'generate', 'queued', '{}', 0)")
    r = _start(home)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(db) in r.stderr and "older" in r.stderr and "adapters" in r.stderr and "move it aside" in r.stderr
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
        assert [r[1] for r in conn.execute("PRAGMA table_info(jobs)")] == \
            ["seq", "id", "kind", "status", "params", "created_at"]
        assert conn.execute("SELECT id FROM jobs").fetchall() == [("oldjob000000",)]
