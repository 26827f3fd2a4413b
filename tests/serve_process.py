"""Waiting for a ``selfspec serve`` subprocess to answer, for the system tests that start one."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest


def wait_until_serving(root: str, process: subprocess.Popen[str], timeout: float = 120.0) -> None:
    """Return once ``root``'s ``/health`` answers 200; fail the test (killing ``process``) if it exits or times out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{root}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"selfspec serve did not start: {process.communicate()[1][-2000:]}")
        time.sleep(0.2)
