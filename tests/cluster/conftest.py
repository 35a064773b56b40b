"""Fixtures the cluster test modules share: each module gets its own folder and its own real
``redis-server`` (a module that needs a differently configured one overrides ``redis_server``)."""

from __future__ import annotations

import pytest
from cluster_harness import RedisServer, cluster_directory


@pytest.fixture(scope="module")
def directory():
    with cluster_directory() as path:
        yield path


@pytest.fixture(scope="module")
def redis_server(directory):
    server = RedisServer(directory)
    yield server
    server.stop()
