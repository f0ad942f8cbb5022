"""Measure the credential boundary of a real ``app.py serve`` (docs/security.md quotes it).

    python scripts/measure_auth.py [--seconds 5] [--data-dir DIR] [--root TREE]

(--root: the source tree whose app.py to serve, e.g. an export of main, for a before/after pair.)

Starts ``app.py serve demo:qwen-image --auth u:p --api-key k3y`` on a free loopback port, then
1. guesses: a bounded loop of wrong logins (a new guess each time) for --seconds each, from one
   client address, against Gradio's POST /login and against /v1/models with a wrong Bearer key;
   prints answers per second by status (429: refused unchecked), so the real guesses per second,
   and what the right login gets right after from that address and from another;
2. memory: the server's RSS (psutil, the serving process) before and after four 60 MiB request
   bodies sent to /v1/images/generations with a wrong key.
Prints the load average with the figures (the machine is shared).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc, base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: app.py serve exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit("error: app.py serve did not come up")


def client(source: str) -> httpx.Client:
    return httpx.Client(timeout=10, transport=httpx.HTTPTransport(local_address=source))


def guesses(seconds: float, source: str, send) -> tuple[float, dict]:
    counts, n, start = {}, 0, time.monotonic()
    with client(source) as c:
        while time.monotonic() - start < seconds and n < 100_000:
            status = send(c, n).status_code
            counts[status] = counts.get(status, 0) + 1
            n += 1
    return n / (time.monotonic() - start), counts


def big_body(port: int, size: int, source: str) -> None:
    """One POST of ``size`` bytes with a wrong key, sent in full if the server lets it (raw socket)."""
    head = (f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode()
    chunk = b" " * (1 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as s:
        try:
            s.sendall(head)
            for _ in range(size // len(chunk)):
                s.sendall(chunk)
            s.sendall(b" " * (size % len(chunk)))
            s.recv(4096)
        except OSError:
            pass  # refused early and closed: what we want


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--data-dir", default=os.environ.get("LORA_STUDIO_HOME"))
    p.add_argument("--root", default=str(ROOT), help="the source tree to serve (default: this one)")
    a = p.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "app.py", "serve", "demo:qwen-image", "--port", str(port), "--device", "cpu",
           "--auth", "u:p", "--api-key", "k3y"] + (["--data-dir", a.data_dir] if a.data_dir else [])
    proc = subprocess.Popen(cmd, cwd=a.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(proc, base)
        print("command:", " ".join(cmd[1:]), "in", a.root)
        print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
        rate, counts = guesses(a.seconds, "127.0.0.2",
                               lambda c, n: c.post(base + "/login", data={"username": "u", "password": f"x{n}"}))
        with client("127.0.0.2") as same, client("127.0.0.3") as other:
            ok = [c.post(base + "/login", data={"username": "u", "password": "p"}).status_code for c in (same, other)]
        real = sum(v for k, v in counts.items() if k != 429) / a.seconds
        print(f"POST /login wrong password: {rate:.1f} answers/s, {real:.1f} checked guesses/s over {a.seconds:.0f}s, "
              f"statuses {counts}; right password right after: {ok[0]} (same address), {ok[1]} (another)")
        rate, counts = guesses(a.seconds, "127.0.0.4",
                               lambda c, n: c.get(base + "/v1/models", headers={"Authorization": f"Bearer x{n}"}))
        with client("127.0.0.4") as same, client("127.0.0.5") as other:
            ok = [c.get(base + "/v1/models", headers={"Authorization": "Bearer k3y"}).status_code
                  for c in (same, other)]
        real = sum(v for k, v in counts.items() if k != 429) / a.seconds
        print(f"GET /v1/models wrong key: {rate:.1f} answers/s, {real:.1f} checked guesses/s over {a.seconds:.0f}s, "
              f"statuses {counts}; right key right after: {ok[0]} (same address), {ok[1]} (another)")
        server = psutil.Process(proc.pid)
        before = server.memory_info().rss
        peak = before
        for i in range(4):
            big_body(port, 60 << 20, f"127.0.0.{10 + i}")
            peak = max(peak, server.memory_info().rss)
        time.sleep(1)
        after = server.memory_info().rss
        print(f"RSS for four refused 60 MiB bodies (wrong key): before {before / 2**20:.0f} MiB, "
              f"peak seen {peak / 2**20:.0f} MiB, after {after / 2**20:.0f} MiB")
        print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
