"""The streaming path's pieces on their own.

* The streamed text's holdback decoding only the new ids (`streaming.HeldBackText` with
  `concatenates`) hands out exactly what decoding every id on every piece hands out: the same
  deltas, piece by piece, for random ids (partial and invalid UTF-8, added tokens), markers and stop
  strings split across pieces, with and without held trailing whitespace.
* A stream's one send deadline (`guards._SendDeadline`) ends a send that waits past it, never a
  stream of quick sends however long, and leaves a cancellation from elsewhere a cancellation.
"""

from __future__ import annotations

import asyncio
import os
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from palaestra.gateway.guards import _SendDeadline
from palaestra.gateway.renderer import ChatRenderer, _decode_concatenates
from palaestra.gateway.streaming import HeldBackText

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
