"""The SQLite job queue on its own: durability, ordering, bounds, recovery (no worker)."""
from __future__ import annotations

import sqlite3

import pytest

from backend.jobs.queue import JobNotFound, JobQueue, QueueFull, group_key

A = [{"name": "a", "path": "/x/a.safetensors", "scale": 1.0}]
B = [{"name": "b", "path": "/x/b.safetensors", "scale": 1.0}]


def _q(tmp_path, **kw) -> JobQueue:
    return JobQueue(tmp_path / "jobs.sqlite", **kw)


def _submit(q, adapters=None, kind="generate", model="m", **params):
    return q.submit(kind, model=model, params={"prompt": "p", **params}, adapters=adapters)


def _run_all(q, group=None) -> list[str]:
    """Claim every job the way the supervisor does; the order they ran in."""
    order = []
    while (job := q.claim(group)) is not None:
        order.append(job["id"])
        group = group_key(job["model"], job["adapters"], job["preset"])
        q.finish(job["id"], "succeeded", result={"path": "x"})
    return order


def test_a_job_is_a_committed_row_before_submit_returns(tmp_path):
    q = _q(tmp_path)
    job = _submit(q, seed=7)
    # a second, independent connection (another process) sees it already
    row = sqlite3.connect(tmp_path / "jobs.sqlite").execute(
        "SELECT status, params FROM jobs WHERE id=?", (job["id"],)).fetchone()
    assert row[0] == "queued" and '"seed": 7' in row[1]
    assert sqlite3.connect(tmp_path / "jobs.sqlite").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert job["queue_position"] == 1 and job["progress"] == {"step": 0, "total": 0}
    assert set(job) >= {"id", "kind", "status", "progress", "queue_position", "model", "params", "adapters",
                        "preset", "created_at", "started_at", "finished_at", "result", "error"}


def test_full_queue_is_refused_with_429_and_nothing_is_written(tmp_path):
    q = _q(tmp_path, max_queue=2)
    _submit(q), _submit(q)
    with pytest.raises(QueueFull) as exc:
        _submit(q)
    assert exc.value.http_status == 429 and "--max-queue 2" in exc.value.message
    assert q.counts()["queued"] == 2
    q.finish(q.claim(None)["id"], "succeeded")  # running/finished jobs do not count
    _submit(q)
    assert q.counts()["queued"] == 2



def test_affinity_groups_same_setup_and_counts_saved_switches(tmp_path):
    q = _q(tmp_path, max_overtake=10)
    ids = [_submit(q, adapters=x)["id"] for x in (A, B, A, B, A)]
    order = _run_all(q, group=group_key("m", A, None))
    assert order == [ids[0], ids[2], ids[4], ids[1], ids[3]]
    stats = q.scheduler_stats()
    assert stats["switches"] == 1 and stats["fifo_switches"] == 4 and stats["switches_saved"] == 3


def test_no_job_is_overtaken_more_than_the_bound(tmp_path):
    q = _q(tmp_path, max_overtake=2)
    first_b = _submit(q, adapters=B)["id"]
    a_ids = [_submit(q, adapters=A)["id"] for _ in range(5)]
    order = _run_all(q, group=group_key("m", A, None))
    # two A jobs may pass the B job, then it must run
    assert order[:3] == [a_ids[0], a_ids[1], first_b]
    assert q.get(first_b)["overtaken"] == 2
    assert q.scheduler_stats()["max_overtaken_seen"] == 2


def test_zero_bound_is_plain_fifo(tmp_path):
    q = _q(tmp_path, max_overtake=0)
    ids = [_submit(q, adapters=x)["id"] for x in (B, A, B, A)]
    assert _run_all(q, group=group_key("m", A, None)) == ids
    assert q.scheduler_stats()["switches_saved"] == 0


def test_nothing_overtakes_a_model_switch(tmp_path):
    q = _q(tmp_path, max_overtake=10)
    b = _submit(q, adapters=B)["id"]
    switch = q.submit("load_model", model="other", params={})["id"]
    a = _submit(q, adapters=A)["id"]
    assert _run_all(q, group=group_key("m", A, None)) == [b, switch, a]


def test_cancel_queued_now_running_by_flag(tmp_path):
    q = _q(tmp_path)
    first, second = _submit(q)["id"], _submit(q)["id"]
    running = q.claim(None)
    assert running["id"] == first
    job, is_running = q.cancel(second)
    assert job["status"] == "cancelled" and not is_running
    job, is_running = q.cancel(first)
    assert is_running and job["status"] == "running" and q.cancel_requested(first)
    assert q.claim(None) is None  # the cancelled one is never handed out
    with pytest.raises(JobNotFound) as exc:
        q.cancel("nope")
    assert exc.value.http_status == 404


def test_a_job_has_a_short_number_that_finds_it(tmp_path):
    """#26: the UI showed 16-hex job ids. Each job has a number (its place in the queue's order, never
    reused), by which it can be read and cancelled as by its id; a number no job has is an unknown job."""
    q = _q(tmp_path)
    jobs = [_submit(q) for _ in range(3)]
    assert [j["number"] for j in jobs] == [1, 2, 3]
    for ref in (2, "2", "#2"):
        assert q.get(ref)["id"] == jobs[1]["id"]
    job, running = q.cancel("#3")
    assert job["id"] == jobs[2]["id"] and job["status"] == "cancelled" and not running
    assert q.get(jobs[2]["id"])["status"] == "cancelled" and q.get(jobs[0]["id"])["status"] == "queued"
    for ref in ("#4", "0", "#", "#2x", "1" * 13):
        with pytest.raises(JobNotFound, match="no job with id"):
            q.get(ref)
    q.close()
    again = _q(tmp_path)  # numbers survive a restart and are not reused
    assert again.get("#1")["id"] == jobs[0]["id"] and _submit(again)["number"] == 4


def test_restart_requeues_a_running_job_once_then_fails_it(tmp_path):
    q = _q(tmp_path)
    job = _submit(q)["id"]
    queued = _submit(q)["id"]
    q.claim(None)
    q.close()
    q = _q(tmp_path)  # "server restart"
    assert q.recover() == {"requeued": 1, "failed": 0}
    assert q.get(job)["status"] == "queued" and q.get(queued)["status"] == "queued"
    assert q.claim(None)["id"] == job  # it keeps its place at the head
    q.close()
    q = _q(tmp_path)
    assert q.recover() == {"requeued": 0, "failed": 1}
    failed = q.get(job)
    assert failed["status"] == "failed" and "restart" in failed["error"]
    assert q.get(queued)["status"] == "queued"


def test_progress_and_result_round_trip(tmp_path):
    q = _q(tmp_path)
    job = _submit(q)["id"]
    q.claim(None)
    q.progress(job, 3, 8)
    assert q.get(job)["progress"] == {"step": 3, "total": 8}
    q.finish(job, "failed", error="bad adapter", error_detail={"status": 400, "type": "x", "param": "lora"})
    got = q.wait(job, timeout=1)
    assert got["status"] == "failed" and got["error"] == "bad adapter" and got["error_detail"]["status"] == 400
    assert q.counts()["failed"] == 1


def test_several_jobs_are_queued_all_or_none(tmp_path):
    """Issue 25.3: a plot queued cell by cell filled the queue and stayed half queued when it ran out of room.
    ``submit_many`` queues every job in one transaction, or none of them."""
    from backend.errors import StudioError

    q = _q(tmp_path, max_queue=5)
    _submit(q, seed=0)
    many = [{"kind": "generate", "model": "m", "params": {"prompt": "p", "seed": i}, "adapters": A, "preset": None}
            for i in range(1, 6)]
    with pytest.raises(QueueFull, match="these 5 jobs do not all fit"):
        q.submit_many(many)  # 1 queued + 5 > 5
    assert len(q.list(limit=100)) == 1
    with pytest.raises(StudioError, match="unknown job kind"):
        q.submit_many([*many[:2], {**many[2], "kind": "bogus"}])
    assert len(q.list(limit=100)) == 1
    jobs = q.submit_many(many[:4])
    assert [j["params"]["seed"] for j in jobs] == [1, 2, 3, 4]
    assert [j["queue_position"] for j in jobs] == [2, 3, 4, 5]
