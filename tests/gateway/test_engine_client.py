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


@pytest.mark.parametrize("engine_http", ["bare", "aiohttp"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_connect_that_times_out_is_retried_and_reported_unreachable(
    never_accepting, streaming, engine_http
):
    client = EngineClient(
        never_accepting, connect_timeout_s=0.3, retries=1, retry_backoff_s=0.0, engine_http=engine_http
    )

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


def test_encoded_ids_are_orjsons_bytes_whatever_the_calls():
    """`EncodedIds.dumps` gives `orjson.dumps(ids)` byte for byte over seeded random calls of a few
    sessions (prompts that extend the last one, equal it, are shorter, differ inside it), reuses the
    JSON of a prompt the next one extends, holds no more than `max_ids` ids, and is not fooled by a
    list the caller changes after the call."""
    import random

    import orjson

    from palaestra.gateway.engine_side.encoded_ids import EncodedIds

    rng = random.Random(3)
    enc = EncodedIds(max_ids=300, min_ids=4)
    last: dict[str, list[int]] = {}
    for _ in range(2000):
        key = rng.choice("abcd")
        ids = list(last.get(key, []))
        kind = rng.randrange(5)
        if kind == 0:
            ids += [rng.randrange(200_000) for _ in range(rng.randrange(1, 40))]
        elif kind == 1 and ids:
            ids = ids[: rng.randrange(len(ids))]
        elif kind == 2 and ids:
            ids[rng.randrange(len(ids))] += 1
        elif kind == 3:
            ids = [rng.randrange(200_000) for _ in range(rng.randrange(60))]
        assert enc.dumps(key, ids) == orjson.dumps(ids)
        assert enc._held == sum(len(p) for p, _ in enc._last.values()) <= enc.max_ids
        last[key] = ids
        if rng.random() < 0.1 and ids:
            ids[0] = -1  # the caller's list changes after the call: the next one must not see it
    assert enc.reused > 0

    enc = EncodedIds(min_ids=2)
    first, nxt = [5, 6, 7], [5, 6, 7, 8, 9]
    assert enc.dumps("s", first) == b"[5,6,7]" and enc.dumps("s", nxt) == b"[5,6,7,8,9]"
    assert enc.reused == 3


def test_the_generate_body_is_the_dicts_json_byte_for_byte():
    import orjson

    client = EngineClient("http://127.0.0.1:1", lora_adapter="a")
    sampling = SamplingParams({"temperature": 0.5}, 8)
    ids = list(range(5000))
    for call in range(3):
        ids += [7, 8, 9]
        want = {
            "input_ids": ids,
            "sampling_params": sampling.to_wire(),
            "return_logprob": True,
            "lora_path": "a",
        }
        if call:
            want["top_logprobs_num"] = call
        assert client._body("s", ids, sampling, call, False) == orjson.dumps(want)
    assert client.encoded_ids.reused == 5003 + 5006
