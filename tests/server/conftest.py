"""A real `pdrollout serve` subprocess on 127.0.0.1 (port 0: it prints the port it bound)."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serverproc import ServerProcess, iter_sse  # noqa: E402  (shared with tests outside this folder)


@pytest.fixture(scope="session")
def server(tiny_model):
    """One shared server for the API tests; tests leave it idle, unpaused, default control."""
    s = ServerProcess(tiny_model)
    yield s
    assert s.stop() == 0, s.log


@pytest.fixture
def start_server(tiny_model):
    """Factory for a dedicated server (lifecycle tests that stop it); killed if a test fails."""
    started = []

    def start(*extra: str) -> ServerProcess:
        s = ServerProcess(tiny_model, *extra)
        started.append(s)
        return s
    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.fixture
def sse():
    return sse_events


def sse_events(lines) -> list:
    return list(iter_sse(lines))
