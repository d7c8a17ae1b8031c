"""EngineClient: a connection the engine never accepts is retried as unreachable, not a timeout."""

from __future__ import annotations

import asyncio
import socket

import pytest

from palaestra.gateway.engine_side.engine_client import EngineClient
from palaestra.gateway.engine_side.generation import SamplingParams
from palaestra.gateway.errors import GatewayError


@pytest.fixture
def never_accepting():
    """A port whose accept queue is full: Linux drops further SYNs, so a connect hangs as it does
    to an engine too busy to accept (the kernel answers nothing, the client retransmits)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(4):  # backlog 0 holds one or two; more only wait in SYN_SENT
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    yield f"http://127.0.0.1:{port}"
    for s in [*fillers, server]:
        s.close()


@pytest.mark.parametrize("streaming", [False, True])
def test_a_connect_that_times_out_is_retried_and_reported_unreachable(never_accepting, streaming):
    client = EngineClient(never_accepting, connect_timeout_s=0.3, retries=1, retry_backoff_s=0.0)

    async def call():
        try:
            if streaming:
                async for _ in client.stream("s1", [1, 2], SamplingParams({}, 1)):
                    pass
            else:
                await client.generate("s1", [1, 2], SamplingParams({}, 1))
        finally:
            await client.close()

    with pytest.raises(GatewayError) as caught:
        asyncio.run(call())
    # 503 engine_unavailable (nothing was sent, the caller may try again), never 504 engine_timeout
    assert caught.value.status == 503 and caught.value.code == "engine_unavailable", caught.value
    assert "unreachable" in str(caught.value) and "ConnectionTimeoutError" in str(caught.value)
