"""Shared fixtures: a real redis-server per test session, fresh run ids, repo paths."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from streamrl.launcher.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free loopback port for the whole test session."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def run_id() -> str:
    """A unique run namespace, so tests sharing one Redis never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def python() -> str:
    return sys.executable
