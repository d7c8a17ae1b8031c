"""The streaming path's pieces on their own.

* The streamed text's holdback decoding only the new ids (`streaming.HeldBackText` with
  `concatenates`) hands out exactly what decoding every id on every piece hands out: the same
  deltas, piece by piece, for random ids (partial and invalid UTF-8, added tokens), markers and stop
  strings split across pieces, with and without held trailing whitespace.
* A stream's one send deadline (`guards._SendDeadline`) ends a send that waits past it, never a
  stream of quick sends however long, and leaves a cancellation from elsewhere a cancellation.
* A client that leaves while the gateway waits for the engine (each turn route, under servers of ASGI
  spec 2.3 and 2.4) drops the engine's request and leaves no half turn (`guards.GuardedStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time
import types

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from palaestra.gateway.guards import GuardedStream, _SendDeadline
from palaestra.gateway.renderer import ChatRenderer, _decode_concatenates
from palaestra.gateway.streaming import HeldBackText
from tests.support.servers import ThreadServer

EXAMPLES = int(os.environ.get("PALAESTRA_FUZZ_EXAMPLES", "120"))
PROPERTY = settings(
    max_examples=EXAMPLES * 4,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
HELD = ["<tool_call>", "<think>", "ab", "é中", "\n\n", "</", "\ufffd", "aba"]
"""Markers and stop strings drawn from: markup, short ones that overlap themselves, multi-byte ones."""
TEXT = st.text(alphabet="ab< >/\nétoolcallthink中😀_", max_size=40)


def _deltas(held: HeldBackText, ids: list[int], cuts: list[int]) -> list[str]:
    """Each piece's delta, the ids arriving in pieces ending at `cuts` (and at the end)."""
    ends = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
    return [held.advance(ids[:end]) for end in ends]


@st.composite
def streams(draw, vocab: int, encode) -> tuple[list[int], list[int]]:
    """Ids from text (markers and multi-byte characters whole or split across ids) mixed with random
    ids (single bytes that are no whole UTF-8 character, added tokens), and where pieces end."""
    ids: list[int] = []
    for part in draw(st.lists(st.one_of(TEXT, st.sampled_from(HELD), st.lists(st.integers(0, vocab - 1))))):
        ids += encode(part) if isinstance(part, str) else part
    cuts = draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    return ids, cuts


def _check(decode, ids, cuts, markers, stops, hold_space):
    plain = HeldBackText(decode, markers, stops, hold_space)
    fast = HeldBackText(decode, markers, stops, hold_space, concatenates=True)
    assert _deltas(fast, ids, cuts) == _deltas(plain, ids, cuts)
    assert fast.sent == plain.sent
    text = decode(ids)
    assert text.startswith(fast.sent)


@pytest.fixture(scope="module")
def decoders(tok):
    renderer = ChatRenderer(tok)
    assert renderer.decode_concatenates  # the `tiny` preset's byte-level BPE, read through the backend
    return renderer


def test_decoding_only_new_ids_gives_every_delta_decoding_all_gives(decoders, tok):
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731

    @given(
        streams(len(tok), encode),
        st.lists(st.sampled_from(HELD), max_size=3),
        st.lists(st.sampled_from(HELD) | TEXT.filter(bool), max_size=3),
        st.booleans(),
    )
    @PROPERTY
    def check(stream, markers, stops, hold_space):
        ids, cuts = stream
        _check(decoders.decode, ids, cuts, markers, stops, hold_space)

    check()


def test_concatenation_holds_where_the_text_ends_on_a_whole_character(decoders, tok):
    """The property the fast path rests on, checked on the decoder itself."""

    @given(st.lists(st.integers(0, len(tok) - 1), max_size=30), st.integers(0, 30))
    @PROPERTY
    def check(ids, p):
        head = decoders.decode(ids[:p])
        if not head.endswith("\ufffd"):
            assert head + decoders.decode(ids[p:]) == decoders.decode(ids)

    check()


def test_a_tool_call_held_whole_costs_nothing_after_its_marker(decoders, tok):
    text = 'Let me look.\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    calls: list[int] = []

    def decode(part: list[int]) -> str:
        calls.append(len(part))
        return decoders.decode(part)

    held = HeldBackText(decode, ["<tool_call>"], [], hold_space=True, concatenates=True)
    sent = "".join(held.advance(ids[:k]) for k in range(1, len(ids) + 1))
    assert sent == "Let me look."
    marker_end = next(k for k in range(len(ids)) if "<tool_call>" in decoders.decode(ids[:k]))
    assert len(calls) == marker_end  # no decoding once the marker is there
    assert max(calls) <= 2  # each piece decodes its own ids (one, or two when a character spans them)


def test_decoders_that_change_earlier_text_decode_every_id():
    byte_level = types.SimpleNamespace(decoder=__import__("tokenizers").decoders.ByteLevel())
    metaspace = types.SimpleNamespace(decoder=__import__("tokenizers").decoders.Metaspace())
    plain = types.SimpleNamespace(clean_up_tokenization_spaces=False)
    assert _decode_concatenates(byte_level, plain)
    assert not _decode_concatenates(metaspace, plain)  # strips the first word's space
    assert not _decode_concatenates(byte_level, types.SimpleNamespace(clean_up_tokenization_spaces=True))
    assert not _decode_concatenates(None, plain)  # transformers' own decode


# -- the send deadline ----------------------------------------------------------------------------
async def _send(deadline: _SendDeadline, wait_s: float) -> str:
    """One send through the deadline, as `GuardedStream` makes it: 'sent', or 'timeout'."""
    deadline.start()
    try:
        await asyncio.sleep(wait_s)
    except asyncio.CancelledError:
        if deadline.timed_out():
            return "timeout"
        raise
    deadline.deadline = None
    return "sent"


def test_a_send_waiting_past_the_deadline_times_out_and_quick_ones_never_do():
    async def stream(waits: list[float]) -> list[str]:
        deadline = _SendDeadline(0.15)
        try:
            out = []
            for wait in waits:
                out.append(await _send(deadline, wait))
                if out[-1] == "timeout":
                    break
                await asyncio.sleep(0.004)  # the next event being made: no send waits
            return out
        finally:
            deadline.close()

    quick = asyncio.run(stream([0.005] * 40))  # 0.35 s of sends, each well inside the deadline
    assert quick == ["sent"] * 40
    late = asyncio.run(stream([0.005, 0.08, 0.1, 0.4, 0.005]))  # the fourth waits past it
    assert late == ["sent", "sent", "sent", "timeout"]


def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    async def main() -> None:
        deadline = _SendDeadline(10.0)
        task = asyncio.current_task()
        asyncio.get_running_loop().call_later(0.01, task.cancel)  # the client went away
        try:
            await _send(deadline, 1.0)
        finally:
            deadline.close()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_a_stream_whose_last_message_finds_no_room_is_cut_too():
    """uvicorn waits for room before each write, the stream's closing message too: a client that
    stopped reading just before it must not hold the connection for good."""
    from prometheus_client import CollectorRegistry, Counter

    cut = Counter("cut", "", ["reason"], registry=CollectorRegistry())
    sent: list[dict] = []

    async def events():
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    async def send(message: dict) -> None:  # TEST DOUBLE of uvicorn's send: no room after the events
        if message["type"] == "http.response.body" and not message["more_body"]:
            await asyncio.Event().wait()
        sent.append(message)

    async def receive() -> dict:  # the client never leaves
        await asyncio.Event().wait()

    async def main() -> None:
        stream = GuardedStream(events(), send_timeout_s=0.05, cut=cut)
        # the bound only stops a hang: the cut comes 0.05 s after the last message began
        await asyncio.wait_for(stream({"type": "http"}, receive, send), 60)

    asyncio.run(main())
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert cut.labels(reason="send_timeout")._value.get() == 1
    assert cut.labels(reason="client_disconnected")._value.get() == 0


class HeldEngine:
    """TEST DOUBLE of an engine that never answers a /generate: it holds each one until the caller
    closes the connection, and records that it was asked and that it was left (what the real engine
    does then is abort the request)."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.left = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] != "/generate":
            body = b'{"context_length": 32768}' if scope["path"] == "/server_info" else b"{}"
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        while (await receive()).get("more_body"):
            pass
        self.asked.set()
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left.set()


def spec_version(app, version: str):
    """`app` served as by a server of that ASGI spec version (uvicorn says 2.3; Starlette's
    StreamingResponse listens for a disconnect only below 2.4)."""

    async def served(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": version}}
        await app(scope, receive, send)

    served.state = app.state
    return served


@pytest.mark.parametrize("version", ["2.3", "2.4"])
@pytest.mark.parametrize("route", ["messages", "chat/completions", "responses"])
def test_a_client_that_leaves_while_the_engine_answers_drops_the_engine_call(tok, tmp_path, version, route):
    """The client goes away while the gateway waits for the engine (nothing of the answer sent yet):
    the stream is cancelled, the engine's request dropped, the session left without a half turn."""
    from palaestra.gateway.app import create_app
    from tests.support.servers import ENV_KEY, gateway_config

    engine = HeldEngine()
    key = {"Authorization": f"Bearer {ENV_KEY}"}
    body = {"model": "m", "stream": True}
    if route == "responses":
        body |= {"input": "hi", "max_output_tokens": 8}
    else:
        body |= {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with ThreadServer(engine) as eng:
        app = create_app(gateway_config(eng.url, tmp_path / "spool"), tokenizer=tok)
        with ThreadServer(spec_version(app, version)) as gw:
            sid = httpx.post(f"{gw.url}/sessions", json={}, headers=key).json()["session_id"]
            cut = cut_count(gw.url, key)

            async def leave() -> None:
                async with httpx.AsyncClient(timeout=120, headers=key) as client:
                    call = asyncio.create_task(client.post(f"{gw.url}/s/{sid}/v1/{route}", json=body))
                    # the engine asked, or the call over (a refusal: then its answer says why); the
                    # bound only ends a hang, the test waits on the events, not on a duration
                    asked = asyncio.ensure_future(asyncio.to_thread(engine.asked.wait, 120))
                    await asyncio.wait({call, asked}, return_when=asyncio.FIRST_COMPLETED)
                    assert not call.done(), call.result().text
                    assert await asked, "the engine was never asked"
                    call.cancel()  # the client goes away: its connection closes
                    with contextlib.suppress(asyncio.CancelledError):
                        await call

            asyncio.run(leave())
            assert engine.left.wait(120), "the gateway kept waiting on the engine for a client that left"
            deadline = time.monotonic() + 120
            while cut_count(gw.url, key) != cut + 1:
                assert time.monotonic() < deadline, "the stream's cut was not counted"
                time.sleep(0.02)
            assert httpx.get(f"{gw.url}/sessions/{sid}", headers=key).json()["turns"] == []


def cut_count(url: str, key: dict[str, str]) -> float:
    text = httpx.get(f"{url}/metrics", headers=key).text
    found = re.search(
        r'^palaestra_gateway_streams_cut_total\{reason="client_disconnected"\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0
