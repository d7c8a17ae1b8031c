"""The incremental parse of a session's request bodies (gateway/sessions/body_memo.py) against a
whole parse (`guards.read_json`: orjson): random sequences of bodies of each dialect's shape, as SDKs
write them (whitespace, escapes, key order, duplicate keys), appended to, edited, cut and broken;
every body must come out the same (its JSON written back, key order included) or be refused with
the same 400, counted the same.

    .venv/bin/python -m pytest -q tests/gateway/test_body_memo.py
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter

from palaestra.gateway.errors import GatewayError
from palaestra.gateway.guards import MAX_JSON_DEPTH, read_json
from palaestra.gateway.sessions import body_memo, history
from palaestra.gateway.sessions.body_memo import BodyMemo, _close, _locate
from palaestra.gateway.sessions.history import ParseMemo

SHAPES = {  # route -> (history key, the other keys a body of it may have)
    "chat": ("messages", ["model", "max_tokens", "stream", "tools", "temperature", "stop"]),
    "responses": ("input", ["model", "instructions", "tools", "max_output_tokens", "store"]),
    "messages": ("messages", ["model", "system", "max_tokens", "tools", "stream"]),
}
TRICKY = ['a"b', "a\\", "\\", '\\"', "é", "💡", "\u2028", "x\ny", "]", "}", "[{", "\\u0041", "\x7f", ""]


def _text(rng: random.Random) -> str:
    text = "".join(rng.choice(TRICKY + ["hi", " ", "ok"]) for _ in range(rng.randrange(4)))
    if rng.random() < 0.1:  # a long one (the scanner skips those with bytes.find)
        text = text.join(rng.choice(["x" * 70, "é" * 40, "\\" * 50]) for _ in range(rng.randrange(1, 3)))
    return text


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1])
    if kind == 1:
        return rng.choice([1.0, 0.5, -0.0, 1e300, 1.5e-7])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4, 5):
        return _text(rng)
    if kind in (6, 7):
        return {_text(rng) or "k": _value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]


def _item(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.05:  # not every item is an object
        return _value(rng, 2)
    item: dict[str, Any] = {"role": rng.choice(["user", "assistant", "tool"]), "content": _text(rng)}
    if r < 0.4:
        item["content"] = [{"type": "text", "text": _text(rng)} for _ in range(rng.randrange(3))]
    if r < 0.2:
        item["extra"] = _value(rng, 1)
    return item


class Writer:
    """One SDK's way of writing JSON: separators, indent, ASCII escapes."""

    def __init__(self, rng: random.Random) -> None:
        self.item_sep = rng.choice([",", ", ", ",\n  ", " , "])
        self.colon = rng.choice([":", ": ", " : "])
        self.ascii = rng.random() < 0.5
        self.outer = rng.choice(["", " ", "\n", "\t", "\r\n"])

    def value(self, v: Any) -> str:
        return json.dumps(v, ensure_ascii=self.ascii, separators=(self.item_sep, self.colon))

    def body(self, pairs: list[tuple[str, Any]]) -> bytes:
        inner = self.item_sep.join(f"{self.value(k)}{self.colon}{self.value(v)}" for k, v in pairs)
        return f"{self.outer}{{{self.outer}{inner}{self.outer}}}{self.outer}".encode()


BREAKS = [
    lambda raw: raw[:-2],  # cut short
    lambda raw: raw + b"x",
    lambda raw: raw.replace(b"]", b",]", 1),  # a trailing comma
    lambda raw: raw.rstrip()[:-1] + b",}",
    lambda raw: raw.rstrip()[:-1] + b',"z":NaN}',
    lambda raw: raw.rstrip()[:-1] + b',"z":123456789012345678901234567890}',
    lambda raw: raw.rstrip()[:-1] + b',"z":"\\ud800"}',
    lambda raw: raw.rstrip()[:-1] + b',"z":"\xff"}',
    lambda raw: (
        raw.rstrip()[:-1] + b',"z":' + b"[" * (MAX_JSON_DEPTH + 2) + b"]" * (MAX_JSON_DEPTH + 2) + b"}"
    ),
    lambda raw: raw.rstrip()[:-1] + b',"z":' + b"[" * 1100 + b"]" * 1100 + b"}",
]


def _append_raw(raw: bytes, key: str, text: bytes) -> bytes:
    """`raw` with `text` written in as its history's last item, by hand (to break it inside)."""
    located = _locate(raw, key)
    if located is None:
        return raw
    start, close, _ = located
    sep = b"," if raw[start + 1 : close].strip() else b""
    return raw[:close] + sep + text + raw[close:]


ITEM_BREAKS = [
    b'{"role":"user","content":"x"',  # unclosed
    b'{"role":"user","content":"x\\"}',  # an escaped quote that leaves the string open
    b'{"role":"user","content":"\xc3"}',  # bad UTF-8
    b'{"role":"user","content":NaN}',
    b'{"role":"user","content":"\\udc00"}',
    b'{"a":1}{"b":2}',
    b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1),  # too deep two levels down
    b"[" * (MAX_JSON_DEPTH - 2) + b"]" * (MAX_JSON_DEPTH - 2),  # just deep enough
    b"[" * 1023 + b"]" * 1023,
    b'"\\\\"',  # a string ending in an escaped backslash
    b"12",
    b"1.0",
    b"true",
    b'{"x":"]"}',
]


def _outcome(parse, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", orjson.dumps(parse(raw))
    except GatewayError as exc:
        return "error", (exc.status, exc.code, exc.message)


def _counts(counter: Counter) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")
    }


def _counter() -> Counter:
    return Counter("rejected", "refused bodies", ["reason"], registry=CollectorRegistry())


@pytest.fixture(autouse=True)
def small_bodies_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo for bodies of any size (the generated ones are small; `MIN_BYTES` keeps the memo
    to bodies over 8 KB)."""
    monkeypatch.setattr(history, "MIN_BYTES", 0)


def _check_kept(kept: BodyMemo) -> None:
    """What a memo keeps is what it says: its prefix's array holds its items, and each kept end
    closes the items it counts."""
    if not kept.prefix:
        return
    start = len(kept.head) - len(b"null}")
    assert kept.prefix[start] == ord("[")
    assert orjson.loads(kept.prefix[start:] + b"]") == kept.items
    for count, end in kept.ends:
        assert orjson.dumps(orjson.loads(kept.prefix[start:end] + b"]")) == orjson.dumps(kept.items[:count])


@pytest.mark.parametrize("route", sorted(SHAPES))
def test_incremental_parse_equals_whole_parse(route: str) -> None:
    key, others = SHAPES[route]
    rng = random.Random(f"body-memo-{route}")
    hits = edits = 0
    for _ in range(1500):
        memo, plain_rejected, memo_rejected = ParseMemo(), _counter(), _counter()
        writer = Writer(rng)
        history = [_item(rng) for _ in range(rng.randrange(4))]
        names = rng.sample(others, rng.randrange(len(others) + 1))
        pairs: list[tuple[str, Any]] = [(n, _value(rng, 1)) for n in names]
        pairs.insert(rng.randrange(len(pairs) + 1), (key, history))
        for _step in range(rng.randrange(2, 7)):
            move = rng.random()
            history = list(history)
            if move < 0.5:  # the common case: the reply and a new message appended
                history += [_item(rng) for _ in range(rng.randrange(3))]
            elif move < 0.58 and history:  # one of the last items edited (a cache marker moved)
                history[-rng.randrange(1, min(len(history), body_memo.ENDS + 1) + 1)] = _item(rng)
            elif move < 0.63 and history:
                del history[rng.randrange(len(history))]
            elif move < 0.68:
                rng.shuffle(pairs)
            elif move < 0.72:
                writer = Writer(rng)
            elif move < 0.75:
                history = []
            elif move < 0.78:  # the array missing, or not an array
                pairs = [p for p in pairs if p[0] != key] + ([] if rng.random() < 0.5 else [(key, "text")])
            elif move < 0.81:  # a key written twice (the history's too)
                pairs.append(rng.choice(pairs) if pairs else ("model", "m"))
            elif move < 0.85:
                names = [n for n in others if n not in dict(pairs)]
                if names:
                    pairs.append((rng.choice(names), _value(rng, 1)))
            if any(p[0] == key for p in pairs):
                at = max(i for i, p in enumerate(pairs) if p[0] == key)
                if isinstance(pairs[at][1], list) or rng.random() < 0.5:
                    pairs[at] = (key, history)
            raw = writer.body(pairs)
            roll = rng.random()
            if roll < 0.08:
                raw = rng.choice(BREAKS)(raw)
            elif roll < 0.16:
                raw = _append_raw(raw, key, rng.choice(ITEM_BREAKS))
            prefix = memo._body.prefix
            hits += prefix != b"" and raw.startswith(prefix)
            want = _outcome(functools.partial(read_json, rejected=plain_rejected), raw)
            got = _outcome(
                functools.partial(memo.read_body, route=route, key=key, rejected=memo_rejected), raw
            )
            assert got == want, raw
            edits += prefix != b"" and not raw.startswith(prefix) and memo._body.misses == 0
            _check_kept(memo._body)
        assert _counts(memo_rejected) == _counts(plain_rejected)
    assert hits > 1500 and edits > 40  # the incremental path was taken, not only the fallback


def test_the_pieces_found_by_the_scanner() -> None:
    raw = b'{"a" : "]}\\"", "messages" :[ {"x":"\\\\"} , [1,{"y":[]}], "]" ] , "b":[1]}'
    start, close, ends = _locate(raw, "messages")  # type: ignore[misc]
    assert raw[start : close + 1] == b'[ {"x":"\\\\"} , [1,{"y":[]}], "]" ]'
    assert [raw[start + 1 : e].strip() for e in ends] == [b'{"x":"\\\\"}', b'{"x":"\\\\"} , [1,{"y":[]}]']
    assert _close(b'"abc', 0) == -1 and _close(b"[1", 1) == -1
    assert _locate(b'{"messages":[],"messages":[]}', "messages") is None  # repeated: whole parses
    assert _locate(b'{"m\\u0065ssages":[1]}', "messages") == (17, 19, [])


def test_reused_items_are_the_previous_objects_and_trusted() -> None:
    """The second body's repeated items are the first body's objects, and the parse memo reuses
    their messages without writing the history out (it never calls orjson.dumps on them)."""
    from palaestra.gateway.dialects import openai_request

    memo, rejected = ParseMemo(), _counter()
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    first = memo.read_body(orjson.dumps({"messages": history, "model": "m"}), "chat", "messages", rejected)
    req1 = openai_request.parse_chat(first, memo)
    history.append({"role": "user", "content": "more"})
    second = memo.read_body(orjson.dumps({"messages": history, "model": "m"}), "chat", "messages", rejected)
    assert all(a is b for a, b in zip(first["messages"], second["messages"], strict=False))
    req2 = openai_request.parse_chat(second, memo)
    assert req2.messages[:2] == req1.messages and req2.messages[0] is req1.messages[0]
    assert memo._raw is None and memo._count == 3  # reused by identity: the history never written
    # a body that does not repeat: parsed whole, and the parse memo compares JSON again
    history[0] = {"role": "user", "content": "changed"}
    third = memo.read_body(orjson.dumps({"messages": history, "model": "m"}), "chat", "messages", rejected)
    req3 = openai_request.parse_chat(third, memo)
    assert req3.messages == openai_request.parse_chat(orjson.loads(orjson.dumps(third))).messages


def test_a_small_body_is_parsed_whole_and_drops_the_kept_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history, "MIN_BYTES", 200)
    memo, rejected = ParseMemo(), _counter()
    big = orjson.dumps({"messages": [{"role": "user", "content": "x" * 300}]})
    memo.read_body(big, "chat", "messages", rejected)
    assert memo._body.prefix
    small = b'{"messages": [{"role": "user", "content": "hi"}], "model": "m"}'
    assert orjson.dumps(memo.read_body(small, "chat", "messages", rejected)) == orjson.dumps(
        orjson.loads(small)
    )
    assert not memo._body.prefix and memo._trusted is None


def test_a_session_that_stops_repeating_is_scanned_one_body_in_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    memo, scans = BodyMemo(), []
    monkeypatch.setattr(body_memo, "_locate", lambda raw, key: scans.append(raw) or _locate(raw, key))
    bodies = [orjson.dumps({"messages": [{"role": "user", "content": f"call {i}"}]}) for i in range(40)]
    for i, raw in enumerate(bodies[: body_memo.MISSES + body_memo.RETRY]):
        assert memo.parse(raw, "chat", "messages") is None
        memo.remember(raw, "chat", "messages", orjson.loads(raw))
        assert len(scans) == min(i + 1, body_memo.MISSES) + (i + 1 == body_memo.MISSES + body_memo.RETRY)
    # the body just scanned is kept: one that repeats it is read incrementally, and scanning resumes
    raw = orjson.dumps(
        {"messages": [*orjson.loads(bodies[body_memo.MISSES + body_memo.RETRY - 1])["messages"], 1]}
    )
    assert memo.parse(raw, "chat", "messages") is not None and memo.misses == 0
    memo.remember(bodies[0], "chat", "messages", orjson.loads(bodies[0]))
    assert len(scans) == body_memo.MISSES + 2


TOOL_TURNS = {  # route -> (history key, body around a history, a tool call and its result, the reply)
    "chat/completions": (
        "messages",
        lambda h: {"model": "tiny", "messages": h, "max_tokens": 8, "tools": [_TOOL_CHAT]},
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": "é\\""}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r\\"}]},
        ],
        lambda a: [{"role": "assistant", "content": a["choices"][0]["message"]["content"]}],
    ),
    "responses": (
        "input",
        lambda h: {"model": "tiny", "instructions": "S", "input": h, "max_output_tokens": 8},
        [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "r"},
        ],
        lambda a: a["output"],
    ),
    "messages": (
        "messages",
        lambda h: {"model": "tiny", "system": "S", "messages": h, "max_tokens": 8},
        [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": [1]}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "r"}]},
        ],
        lambda a: [{"role": "assistant", "content": a["content"]}],
    ),
}
_TOOL_CHAT = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "created", "created_at")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _sessions(gw: Any, hot: bool) -> list[Any]:
    """Each turn route through a 5-call session (tool calls, their results, replies sent back as
    SDKs do, Python's `json.dumps` spacing); what came back: the answers and each turn's prompt ids."""
    import httpx

    from tests.support.servers import ENV_KEY

    key = {"Authorization": f"Bearer {ENV_KEY}", "content-type": "application/json"}
    out: list[Any] = []
    kept = 0
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for path, (field, wrap, tool, reply) in TOOL_TURNS.items():
            sid = http.post("/sessions", json={"env": "e"}, headers=key).json()["session_id"]
            history: list[Any] = [{"role": "user", "content": "Hi."}]
            for turn in range(5):
                raw = json.dumps(wrap(history)).encode()
                answer = http.post(f"/s/{sid}/v1/{path}", content=raw, headers=key).json()
                out.append(_without_ids(answer))
                body = gw.app.state.service.sessions.get(sid).parse_memo._body
                if hot:
                    _check_kept(body)  # the call changed none of the items the next call reuses
                    kept += turn > 0 and body.key == field and len(body.items) == len(history)
                history += reply(answer) + (
                    tool if turn % 2 == 0 else [{"role": "user", "content": f"{turn}"}]
                )
            trajectory = http.get(f"/sessions/{sid}", headers=key).json()
            out.append([t["prompt_ids"] for t in trajectory["turns"]])
    if hot:
        assert kept == 12, kept  # every call after the first read incrementally
    return out


def test_the_gateway_answers_the_same_with_the_memo(tok, tmp_path, monkeypatch):
    from palaestra.testing.zero import make_app
    from tests.support.servers import ThreadServer, gateway_server

    reply = tok.encode("Sure.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    answers = {}
    with ThreadServer(make_app(reply_ids=reply)) as engine:
        for hot in (True, False):
            if not hot:  # every body parsed whole, as before the memo
                monkeypatch.setattr(
                    ParseMemo, "read_body", lambda self, raw, route, key, rejected: read_json(raw, rejected)
                )
            with gateway_server(engine.url, tmp_path / str(hot), tok) as gw:
                answers[hot] = _sessions(gw, hot)
    assert answers[True] == answers[False]
