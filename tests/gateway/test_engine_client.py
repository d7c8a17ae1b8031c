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


def _turn(turn_id: int, parent, prompt: list[int], out: list[int], choice: int = 0):
    from palaestra.gateway.engine_side.generation import FinishReason
    from palaestra.gateway.sessions.trajectory import Turn

    return Turn(
        turn_id=turn_id, call_id=f"c{turn_id}", choice=choice, parent=parent, prompt_ids=prompt,
        output_ids=out, output_logprobs=[-0.5] * len(out), weight_version="0", weight_spans=[],
        finish_reason=FinishReason({"type": "length"}), latency_s=0.0, cached_tokens=0, kind="chat",
    )  # fmt: skip


def test_encoded_ids_are_orjsons_bytes_over_random_sessions_of_turns():
    """Over seeded random sessions of real `Turn`s (bridged continuations, branches off inner turns,
    `n` > 1 choices, continuations of any choice, answers of any length, forks and a client rewriting
    its history: plain lists, a prompt the caller changes after the call), `EncodedIds.dumps` gives
    `orjson.dumps(ids)` byte for byte, reuses the JSON where a bridged prompt continues the last one,
    holds the JSON of no more than `max_ids` ids; and each turn's prompt, taken without comparing
    (`PromptIds`), is the prompt sent."""
    import random

    import orjson

    from palaestra.gateway.engine_side.encoded_ids import EncodedIds
    from palaestra.gateway.sessions.trajectory import PromptIds

    rng = random.Random(3)
    enc = EncodedIds(max_ids=600, min_ids=4)
    turns: dict[str, list] = {key: [] for key in "abcd"}
    sent: list[tuple[list[int], list[int]]] = []  # (a prompt sent, a copy of it then)
    next_id = 0

    def fresh(n: int) -> list[int]:
        return [rng.randrange(200_000) for _ in range(n)]

    for _ in range(1500):
        key = rng.choice("abcd")
        known = turns[key]
        kind = rng.randrange(6)
        if known and kind < 4:  # bridged: usually the last turn, else any earlier one (a branch)
            parent = known[-1] if kind < 3 else rng.choice(known)
            ids: list[int] = parent.extended(fresh(rng.randrange(0, 30)))
        elif known and kind == 4:  # the client rewrote its history: a plain list that differs inside
            parent, ids = None, list(rng.choice(known).prompt())
            if ids:
                ids[rng.randrange(len(ids))] += 1
        else:  # a fork or a first call
            parent, ids = None, fresh(rng.randrange(1, 80))
        want = orjson.dumps(list(ids))
        assert enc.dumps(key, ids) == want
        assert enc._held == sum(s.start + len(s.tail) for s in enc._last.values()) <= enc.max_ids
        sent.append((ids, list(ids)))
        for choice in range(rng.choice([1, 1, 1, 3])):  # n > 1: the other choices get lists of their own
            next_id += 1
            turn = _turn(next_id, parent, ids, fresh(rng.randrange(1, 12)), choice)
            assert turn.prompt() == list(ids), "a turn's prompt is the prompt sent"
            assert turn.tokens[: turn.end] == list(ids) + turn.output_ids
            known.append(turn)
        if parent is None and rng.random() < 0.1:
            ids[0] = -1  # the caller's plain list changes after the call: nothing may have kept it
        if len(known) > 40:  # the session ends; its key starts again
            turns[key] = []
    assert enc.reused > 0
    assert all(ids[1:] == copy[1:] for ids, copy in sent)  # no list was changed by the calls

    enc = EncodedIds(min_ids=2)
    root = _turn(1, None, [5, 6, 7], [8])
    first = root.extended([9])
    assert isinstance(first, PromptIds) and first == [5, 6, 7, 8, 9]
    assert enc.dumps("s", first) == b"[5,6,7,8,9]" and enc.reused == 0  # nothing before it on `root`
    child = _turn(2, root, first, [10])
    assert child.tokens is root.tokens  # appended, not copied
    assert enc.dumps("s", child.extended([11])) == b"[5,6,7,8,9,10,11]" and enc.reused == 5
    assert enc.dumps("s", [5, 6, 7, 8, 9, 10, 11, 12]) == b"[5,6,7,8,9,10,11,12]"  # a plain list: whole
    assert enc.reused == 5

    enc.forget("s")  # the session ended: nothing of it is held
    assert "s" not in enc._last and enc._held == 0
    enc.forget("s")

    # a long chain: the pieces kept are joined into one now and then, the bytes stay orjson's
    from palaestra.gateway.engine_side.encoded_ids import MAX_PIECES

    turn = _turn(1, None, [1, 2], [3])
    for i in range(3 * MAX_PIECES):
        ids = turn.extended([i, -i] if i % 3 else [])
        assert enc.dumps("long", ids) == orjson.dumps(list(ids))
        assert len(enc._last["long"].head) <= MAX_PIECES
        turn = _turn(i + 2, turn, ids, [i % 7])


def test_the_generate_body_is_the_dicts_json_byte_for_byte():
    import orjson

    client = EngineClient("http://127.0.0.1:1", lora_adapter="a")
    sampling = SamplingParams({"temperature": 0.5}, 8)
    turn = _turn(1, None, list(range(5000)), [7])
    for call in range(3):
        ids = turn.extended([8, 9])  # each call's prompt: the last one's, its answer, a bridge
        turn = _turn(call + 2, turn, ids, [7])
        want = {
            "input_ids": list(ids),
            "sampling_params": sampling.to_wire(),
            "return_logprob": True,
            "lora_path": "a",
        }
        if call:
            want["top_logprobs_num"] = call
        assert b"".join(client._body("s", ids, sampling, call, False)) == orjson.dumps(want)
    assert client.encoded_ids.reused == 5003 + 5006  # the second and third calls: the JSON before


def test_prompt_ids_read_as_the_list_they_stand_for():
    """A `PromptIds` answers len, indexing (negative too), slices, iteration, `==` and `+` as
    `base[:start] + tail` would, also after `base` grew past `start`; `list_of` copies it."""
    from palaestra.gateway.sessions.trajectory import PromptIds, list_of

    base = [1, 2, 3, 4]
    ids = PromptIds(base, 3, [7, 8])
    base += [9, 9]  # grown past `start`: the prompt is unchanged
    want = [1, 2, 3, 7, 8]
    assert len(ids) == 5 and [ids[i] for i in range(-5, 5)] == want * 2 and list(ids) == want
    assert ids[1:4] == want[1:4] and ids[::-1] == want[::-1] and ids == want and ids != [*want, 0]
    assert ids == PromptIds([1, 2, 3], 3, [7, 8]) and ids + [5] == [*want, 5]
    for bad in (5, -6):
        with pytest.raises(IndexError, match="of 5"):
            ids[bad]
    copy = list_of(ids)
    assert copy == want and copy is not list_of(ids) and list_of(copy) is copy
