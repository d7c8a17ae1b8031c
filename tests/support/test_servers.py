"""The `ScriptedEngine` double streams as SGLang does in both of its modes: the gateway's reader of
SGLang's stream (`_StreamedSample`, in the mode the gateway is told) gets the unstreamed answer."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from palaestra.gateway.engine_side.engine_client import _StreamedSample
from tests.support.servers import ScriptedEngine


async def _stream(engine: ScriptedEngine, body: dict) -> list[bytes]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=engine.app()), base_url="http://e") as c:
        async with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            text = b"".join([part async for part in r.aiter_bytes()])
    return [line[6:] for line in text.split(b"\n") if line.startswith(b"data: ") and line[6:] != b"[DONE]"]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("bunch", [1, 7])  # events read one at a time, or several per socket read
def test_both_stream_modes_give_the_unstreamed_answer(incremental, bunch):
    answer = [*range(10, 60), 2]
    engine = ScriptedEngine(script=lambda ids, i: answer, stop_ids={2}, incremental=incremental)
    body = {"input_ids": [1, 5, 7], "sampling_params": {"max_new_tokens": 200}}
    events = asyncio.run(_stream(engine, body))
    whole = engine.exchanges[-1].answer
    assert len(events) == len(answer)  # a chunk per token, as SGLang's default stream_interval 1
    sample, ids, lps, final = _StreamedSample(incremental), [], [], None
    for i in range(0, len(events), bunch):
        fresh_ids, fresh_lps, final = sample.add(events[i : i + bunch])
        ids, lps = ids + fresh_ids, lps + fresh_lps
    assert ids == whole["output_ids"] == answer
    assert lps == [e[0] for e in whole["meta_info"]["output_token_logprobs"]]
    assert final is not None and sample.finished
    size = sum(map(len, events))
    # deltas: each chunk its token; cumulative: the whole prefix each time (the square of the length)
    assert size < 400 * len(answer) if incremental else size > 10 * len(answer) ** 2
