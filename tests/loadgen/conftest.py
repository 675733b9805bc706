"""Fixtures of the load-generator tests: one stub OpenAI-compatible server per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from loadgen_stub import StubServer


@pytest.fixture(scope="module")
def stub_server() -> Iterator[StubServer]:
    server = StubServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def stub(stub_server: StubServer) -> StubServer:
    """The module's stub server, reset to the default behaviour and an empty request log."""
    stub_server.reset()
    return stub_server
