"""Helpers for tests that start a server program (the Dash app, vLLM's OpenAI server)."""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, url: str, log: Path, timeout: float, what: str, poll: float = 1.0) -> None:
    """Wait until ``url`` answers 200; raise with the end of ``log`` if ``proc`` exits first, kill it
    and raise if ``timeout`` seconds pass."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{Path(log).read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")
        time.sleep(poll)


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
