"""Hostile and malformed input against a gateway over the real embedded engine (tiny preset), while
well-behaved sessions run beside it and must get exact results.

Each test runs one kind of hostile input concurrently with `CALM` well-behaved sessions (multi-turn
chat through the gateway); afterwards every calm session's recorded turns must be exactly the tokens
the engine produced for it (a `RecordingProxy` between gateway and engine records them), its sample
the exact prompt + output of its last engine call, and the hostile input must have been answered
as documented (docs/reliability-input.md) and counted in /metrics.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/gateway/test_hostile.py
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from palaestra.gateway.guards import MAX_ARGUMENTS_DEPTH, MAX_JSON_DEPTH
from palaestra.gateway.http_writes import HeadJoiningProtocol
from palaestra.gateway.streaming import MAX_STOP_CHARS
from tests.support.servers import RecordingProxy, ThreadServer, gateway_server

pytestmark = pytest.mark.engine  # the gateway in front of the shared engine

KEY = {"Authorization": "Bearer k-test"}
LIMIT = 1 << 20  # the gateway's max_body_bytes in these tests
SEND_TIMEOUT_S = 2.0
SNDBUF = 4096  # small socket buffers, so a client that reads nothing fills them within a few hundred events
CALM = 4
STOPS = ["e", "a", "o", "i", " "]  # random weights rarely stop: common letters end turns, so turns bridge


class _SmallWriteBuffer(HeadJoiningProtocol):
    """The gateway's HTTP protocol whose transport holds at most `SNDBUF` bytes unsent before a send
    waits (asyncio's default is 64 KiB)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        transport.set_write_buffer_limits(high=SNDBUF)
        super().connection_made(transport)


class SmallBufferServer(ThreadServer):
    """`ThreadServer` whose listening socket (and so every accepted one, on Linux) has a small send
    buffer, and whose transports hold little unsent: a client that stops reading blocks the
    gateway's sends after a few KiB (tens of tokens' events), not megabytes. With asyncio's 64 KiB
    the tiny engine had to sample ~300-440 of a stream's 448 tokens before a send blocked (measured:
    the stuck stream below), so an answer whose events came in bunches (a loaded machine: fewer,
    larger events) could end inside the buffers and never be cut."""

    def __init__(self, app, http=HeadJoiningProtocol):
        super().__init__(app)
        self.server.config.http = _SmallWriteBuffer  # the gateway's protocol (`http`), small buffers
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        sock.bind(("127.0.0.1", self.port))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)


@pytest.fixture(scope="module")
def gw(proxy, tmp_path_factory):
    _, srv = proxy
    spool = tmp_path_factory.mktemp("spool")
    # max_tokens beyond the context: the strict option (the default clamps; tests/gateway/test_controls.py)
    options = {
        "max_body_bytes": LIMIT,
        "stream_send_timeout_s": SEND_TIMEOUT_S,
        "max_tokens_over_context": "reject",
    }
    with gateway_server(srv.url, spool, server=SmallBufferServer, **options) as server:
        yield server


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=KEY).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = (
        rf"^{re.escape(name)}(?:\{{{re.escape(want)}\}})? (\S+)$" if want else rf"^{re.escape(name)} (\S+)$"
    )
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def new_session(gw) -> dict:
    r = httpx.post(f"{gw.url}/sessions", json={"env": "hostile", "task_id": "t"}, headers=KEY)
    r.raise_for_status()
    return r.json()


async def calm_session(client: httpx.AsyncClient, gw, i: int) -> str:
    """A well-behaved agent: three turns of chat, then its reward."""
    s = (await client.post(f"{gw.url}/sessions", json={"env": "calm", "task_id": str(i)}, headers=KEY)).json()
    msgs = [{"role": "user", "content": f"calm session {i}"}]
    for _ in range(3):
        r = await client.post(
            f"{s['base_url']}/chat/completions",
            headers=KEY,
            json={"model": "tiny", "messages": msgs, "max_tokens": 6, "stop": STOPS},
        )
        assert r.status_code == 200, r.text
        msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
        msgs += [{"role": "user", "content": "more"}]
    r = await client.post(f"{gw.url}/sessions/{s['session_id']}/reward", json={"reward": i}, headers=KEY)
    assert r.status_code == 200, r.text
    return s["session_id"]


def assert_exact(gw, rec: RecordingProxy, sid: str) -> None:
    """The session's turns are exactly the engine's answers to it, and its last sample is exactly
    the last engine call's prompt + output."""
    mine = [e for e in rec.exchanges if e.headers.get("x-smg-routing-key") == sid]
    traj = httpx.get(f"{gw.url}/sessions/{sid}", headers=KEY).json()
    assert mine and [t["output_ids"] for t in traj["turns"]] == [e.answer["output_ids"] for e in mine]
    samples, after = [], 0
    while True:
        page = httpx.get(f"{gw.url}/samples", params={"after": after, "limit": 1000}, headers=KEY).json()
        samples += [s for s in page["samples"] if s["session_id"] == sid]
        if not page["samples"]:
            break
        after = page["cursor"]
    last = max(samples, key=lambda s: s["fork_index"])
    assert last["tokens"] == mine[-1].body["input_ids"] + mine[-1].answer["output_ids"]


def beside_calm_sessions(gw, proxy, hostile: Callable[[], Awaitable[None]], stuck: int = 0) -> None:
    """Runs `hostile` concurrently with CALM well-behaved sessions; checks theirs are exact and
    waits until at most `stuck` calls are in flight (the hostile ones that are still held)."""
    rec, _ = proxy

    async def run():
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            return await asyncio.gather(hostile(), *[calm_session(client, gw, i) for i in range(CALM)])

    _, *calm = asyncio.run(run())
    for sid in calm:
        assert_exact(gw, rec, sid)
    wait_for(lambda: metric(gw.url, "palaestra_gateway_in_flight_calls") <= stuck)


def raw_http(port: int, head: str, chunks: list[bytes] = ()) -> tuple[int, dict]:
    """Sends a request by hand (headers, then `chunks` as they are) and reads the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            sock.sendall(chunk)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            more = sock.recv(65536)
            if not more:
                break
            data += more
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def _length(data: bytes) -> int:
    found = re.search(rb"content-length: (\d+)", data.split(b"\r\n\r\n", 1)[0], re.I)
    return int(found.group(1)) if found else 1 << 30


def _head(sid: str, route: str, extra: str) -> str:
    return (
        f"POST /s/{sid}/v1/{route} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k-test\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    )


def test_oversized_bodies_get_413_before_parsing(gw, proxy):
    sid = new_session(gw)["session_id"]
    before = metric(gw.url, "palaestra_gateway_rejected_requests_total", reason="body_too_large")
    engine_calls = len(proxy[0].exchanges)

    async def hostile():
        loop = asyncio.get_running_loop()
        # a Content-Length over the limit: answered at once, nothing read (no body is even sent)
        status, err = await loop.run_in_executor(
            None, raw_http, gw.port, _head(sid, "chat/completions", "Content-Length: 1000000000\r\n")
        )
        assert status == 413 and err["error"]["code"] == "body_too_large", err
        status, err = await loop.run_in_executor(
            None, raw_http, gw.port, _head(sid, "messages", "Content-Length: 1000000000\r\n")
        )
        assert status == 413 and err == {
            "type": "error",
            "error": {"type": "request_too_large", "message": err["error"]["message"]},
        }
        # a chunked body (no length given) is counted as it arrives
        piece = b"x" * (64 << 10)
        chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (LIMIT // len(piece) + 1) + [b"0\r\n\r\n"]
        for route in ("chat/completions", "messages"):
            status, err = await loop.run_in_executor(
                None, raw_http, gw.port, _head(sid, route, "Transfer-Encoding: chunked\r\n"), chunks
            )
            assert status == 413, err
            assert "max_body_bytes" in (err["error"]["message"]), err

    beside_calm_sessions(gw, proxy, hostile)
    after = metric(gw.url, "palaestra_gateway_rejected_requests_total", reason="body_too_large")
    assert after - before == 4
    assert all(e.headers.get("x-smg-routing-key") != sid for e in proxy[0].exchanges[engine_calls:])


def test_deep_nesting_and_invalid_utf8_are_400s_naming_the_problem(gw, proxy):
    sid = new_session(gw)["session_id"]
    url = f"{gw.url}/s/{sid}/v1/chat/completions"
    reasons = ("nesting_too_deep", "invalid_utf8", "invalid_json")
    before = {r: metric(gw.url, "palaestra_gateway_rejected_requests_total", reason=r) for r in reasons}
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    node = deep_tool["function"]["parameters"]
    for _ in range(300):  # within orjson's parse limit (1024), beyond what it can write back (255)
        node["x"] = {}
        node = node["x"]

    async def hostile():
        async with httpx.AsyncClient(timeout=60, headers=KEY) as c:
            cases = [
                (b"[" * 100_000, "nesting_too_deep"),  # beyond orjson's own limit
                (
                    json.dumps(
                        {"messages": [{"role": "user", "content": "hi"}], "tools": [deep_tool]}
                    ).encode(),
                    "nesting_too_deep",
                ),
                (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid_utf8"),
                (b'{"messages": [', "invalid_json"),
            ]
            for raw, code in cases:
                r = await c.post(url, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
            # tool-call arguments are a JSON *string*: one too deep to parse stays text (was a 500)
            deep_args = "[" * 5000 + "]" * 5000
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_args}}
            history = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
            r = await c.post(url, json={"messages": history, "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await c.post(f"{gw.url}/s/{sid}/v1/messages", content=b"[" * 100_000)
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            assert f"deeper than {MAX_JSON_DEPTH} levels" in r.json()["error"]["message"]

    beside_calm_sessions(gw, proxy, hostile)
    counted = {
        r: metric(gw.url, "palaestra_gateway_rejected_requests_total", reason=r) - before[r] for r in reasons
    }
    assert counted == {"nesting_too_deep": 3, "invalid_utf8": 1, "invalid_json": 1}
    assert len(httpx.get(f"{gw.url}/sessions/{sid}", headers=KEY).json()["turns"]) == 1  # the deep_args call


def nested(levels: int) -> dict:
    """An object `levels` deep: {"x": {"x": ... {}}}."""
    out: dict = {}
    for _ in range(levels - 1):
        out = {"x": out}
    return out


def test_depth_limit_is_exact_and_leaves_room_for_what_the_gateway_writes(gw):
    """A body exactly MAX_JSON_DEPTH deep is served, in every place the gateway writes it back out
    (an Anthropic tool schema is written one level deeper than it came); one level more is a 400."""
    s = new_session(gw)
    msgs = [{"role": "user", "content": "hi"}]
    # body(1) > tools(2) > tool(3) > input_schema: the schema's own depth brings the body to the limit
    tool = {"name": "f", "input_schema": nested(MAX_JSON_DEPTH - 3)}
    r = httpx.post(
        f"{s['base_url']}/messages",
        headers=KEY,
        timeout=60,
        json={"messages": msgs, "max_tokens": 1, "tools": [tool]},
    )
    assert r.status_code == 200, r.text
    tool = {"name": "f", "input_schema": nested(MAX_JSON_DEPTH - 2)}
    r = httpx.post(
        f"{s['base_url']}/messages", headers=KEY, json={"messages": msgs, "max_tokens": 1, "tools": [tool]}
    )
    assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"], r.text
    fn = {"type": "function", "name": "f", "parameters": nested(MAX_JSON_DEPTH - 3)}
    r = httpx.post(
        f"{s['base_url']}/responses",
        headers=KEY,
        timeout=60,
        json={"input": "hi", "max_output_tokens": 1, "tools": [fn], "store": False},
    )
    assert r.status_code == 200, r.text  # the answer echoes the tools back at the same depth


def test_tool_call_arguments_near_the_depth_limit_are_served_in_chat_and_responses(gw):
    """Arguments (a JSON string) nesting just under MAX_JSON_DEPTH were parsed and then written a
    dozen levels down into the session journal, past orjson's 254: a 500 (the Responses fuzz found
    it). Deeper than MAX_ARGUMENTS_DEPTH they stay text; every depth around both limits is served."""
    s = new_session(gw)
    for depth in (
        MAX_ARGUMENTS_DEPTH,
        MAX_ARGUMENTS_DEPTH + 1,
        *range(MAX_JSON_DEPTH - 6, MAX_JSON_DEPTH + 3),
    ):
        args = "[" * depth + "]" * depth
        call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": args}}
        chat = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": "ok"},
        ]
        items = [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c0", "name": "f", "arguments": args},
            {"type": "function_call_output", "call_id": "c0", "output": "ok"},
        ]
        bodies = {
            "chat/completions": {"messages": chat, "max_tokens": 1},
            "responses": {"input": items, "max_output_tokens": 1},
        }
        for route, body in bodies.items():
            r = httpx.post(f"{s['base_url']}/{route}", headers=KEY, timeout=60, json=body)
            assert r.status_code == 200, (route, depth, r.text)


def test_huge_n_and_max_tokens_are_400s_naming_the_field(gw, proxy):
    sid = new_session(gw)["session_id"]
    base = f"{gw.url}/s/{sid}/v1"
    msgs = [{"role": "user", "content": "hi"}]
    before = metric(gw.url, "palaestra_gateway_rejected_requests_total", reason="context_length_exceeded")

    async def hostile():
        async with httpx.AsyncClient(timeout=60, headers=KEY) as c:
            r = await c.post(f"{base}/chat/completions", json={"messages": msgs, "n": 10**9})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "n" and err["code"] == "integer_above_max_value"
            assert "between 1 and 64" in err["message"]
            for field in ("max_tokens", "max_completion_tokens"):
                r = await c.post(f"{base}/chat/completions", json={"messages": msgs, field: 10**9})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            r = await c.post(f"{base}/completions", json={"prompt": "hi", "max_tokens": 10**9})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
            r = await c.post(f"{base}/responses", json={"input": "hi", "max_output_tokens": 10**9})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
            r = await c.post(f"{base}/messages", json={"messages": msgs, "max_tokens": 10**9})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: "), r.text

    beside_calm_sessions(gw, proxy, hostile)
    after = metric(gw.url, "palaestra_gateway_rejected_requests_total", reason="context_length_exceeded")
    assert after - before == 5
    assert metric(gw.url, "palaestra_gateway_rejected_requests_total", reason="integer_above_max_value") >= 1
    assert all(e.headers.get("x-smg-routing-key") != sid for e in proxy[0].exchanges)


def test_prompt_too_long_for_any_tokenization_is_refused_untokenized(gw, proxy, tiny_model_dir):
    """Tokenizing megabytes takes seconds on the loop that serves everyone: a text longer than the
    context x the longest vocabulary string is over the context in any tokenization, refused first."""
    from transformers import AutoTokenizer

    from palaestra.gateway.renderer import ChatRenderer

    s = new_session(gw)
    context = httpx.get(f"{s['base_url']}/models", headers=KEY).json()["data"][0]["max_model_len"]
    bound = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir), context_length=context).max_text_chars
    assert bound + 1000 < LIMIT, "this test needs a body under max_body_bytes that is over the bound"
    text = "word " * (bound // 5 + 100)

    async def hostile():
        async with httpx.AsyncClient(timeout=60, headers=KEY) as c:
            for route, body in (
                ("chat/completions", {"messages": [{"role": "user", "content": text}]}),
                ("completions", {"prompt": text}),
                ("responses", {"input": text}),
            ):
                r = await c.post(f"{s['base_url']}/{route}", json=body)
                err = r.json()["error"]
                assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
                assert err["param"] == {"chat/completions": "messages", "completions": "prompt"}.get(
                    route, "input"
                )
                assert "in any tokenization" in err["message"]

    beside_calm_sessions(gw, proxy, hostile)
    assert all(e.headers.get("x-smg-routing-key") != s["session_id"] for e in proxy[0].exchanges)


def test_long_or_many_stop_strings_are_refused(gw):
    """Stop strings are checked against the text on every streamed token, on the loop that serves
    every session: their length and number are bounded (`streaming.MAX_STOP_CHARS`, 16)."""
    base = f"{gw.url}/s/{new_session(gw)['session_id']}/v1"
    msgs = [{"role": "user", "content": "hi"}]
    long = "x" * (MAX_STOP_CHARS + 1)
    for route, body, field in (
        ("chat/completions", {"messages": msgs, "stop": [long]}, "stop"),
        ("completions", {"prompt": "hi", "stop": long}, "stop"),
        ("responses", {"input": "hi", "stop": [long]}, "stop"),
        ("messages", {"messages": msgs, "max_tokens": 4, "stop_sequences": [long]}, "stop_sequences"),
        ("messages", {"messages": msgs, "max_tokens": 4, "stop_sequences": ["a"] * 17}, "stop_sequences"),
    ):
        r = httpx.post(f"{base}/{route}", json=body, headers=KEY)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err.get("param") == field or err["message"].startswith(field), r.text


def engine_metric(engine_url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{engine_url}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def engine_aborts(engine_url: str) -> float:
    return engine_metric(engine_url, 'palaestra_engine_requests_total\\{finish="abort"\\}')


def engine_idle(engine_url: str) -> bool:
    """Nothing running or waiting: every request the engine was given has ended, one way or another."""
    return not any(
        engine_metric(engine_url, f"palaestra_engine_{what}_requests") for what in ("running", "waiting")
    )


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def flowing_text(tok) -> dict[str, float]:
    """A `logit_bias` that keeps a stream's text flowing: the tiny model's random weights sample
    `<think>` and `<tool_call>` like any other of its 4,096 tokens, and a stream held back all text
    after a `<think>` (and, with tools on, still does after a `<tool_call>`: a call is known only at
    the end). A stuck stream that sampled one early sent nothing more, so no send could block and no
    cut come; with `max_tokens` near the context it generated for hours (a hang seen in CI). The
    bias keeps these tests independent of what a stream may hold."""
    return {str(tok.convert_tokens_to_ids(t)): -100.0 for t in ("<think>", "<tool_call>")}


def text_of(line: str) -> str:
    """The text a chat-completions stream line carries ("" for the role chunk, which says
    `"content": ""` before the gateway has asked the engine anything, and for other lines)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    return "".join(c["delta"].get("content") or "" for c in json.loads(line[6:]).get("choices", []))


def test_client_that_disconnects_mid_stream(gw, proxy, engine, tok):
    s = new_session(gw)
    sid = s["session_id"]
    cut = metric(gw.url, "palaestra_gateway_streams_cut_total", reason="client_disconnected")
    aborts = engine_aborts(engine.url)
    msgs = [{"role": "user", "content": "tell me a long story"}]

    async def hostile():
        async with httpx.AsyncClient(timeout=60, headers=KEY) as c:
            # 8000 tokens: the engine is still generating when the disconnect reaches it, however
            # slowly the gateway and the proxy pass it on (with 400 tokens a busy machine sometimes
            # saw the engine finish first); if it never does, it ends them as `length`
            body = {
                "messages": msgs,
                "max_tokens": 8000,
                "ignore_eos": True,
                "stream": True,
                "logit_bias": flowing_text(tok),
            }
            async with c.stream("POST", f"{s['base_url']}/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    # the first text: the engine is generating this call. Leaving at the role chunk
                    # instead raced the gateway's engine call, and a loaded machine lost it (the
                    # request never reached the engine: nothing to abort)
                    if text_of(line):
                        break  # go away mid-stream

    beside_calm_sessions(gw, proxy, hostile)
    wait_for(
        lambda: metric(gw.url, "palaestra_gateway_streams_cut_total", reason="client_disconnected") == cut + 1
    )
    # The engine has ended every request it was given (the cut call included: its text came), and
    # the cut call ended as an abort, not as its 8000 tokens: no bet on how fast a step is. (The
    # timeout only bounds a hang: the engine ends the call by itself after 8000 tokens.)
    wait_for(lambda: engine_idle(engine.url), timeout_s=900)
    assert engine_aborts(engine.url) >= aborts + 1, "the engine generated the cut call to its end"
    # the session holds no half turn and goes on: the next call is recorded and spooled exactly
    assert httpx.get(f"{gw.url}/sessions/{sid}", headers=KEY).json()["turns"] == []
    r = httpx.post(
        f"{s['base_url']}/chat/completions", headers=KEY, timeout=60, json={"messages": msgs, "max_tokens": 5}
    )
    assert r.status_code == 200, r.text
    assert httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1}, headers=KEY).status_code == 200
    rec, _ = proxy
    mine = [e for e in rec.exchanges if e.headers.get("x-smg-routing-key") == sid]
    assert len(mine) == 2 and mine[0].body["stream"] is True  # the cut call, then the next one
    assert_exact_last(gw, sid, mine[-1])


def assert_exact_last(gw, sid: str, exchange) -> None:
    traj = httpx.get(f"{gw.url}/sessions/{sid}", headers=KEY).json()
    assert [t["output_ids"] for t in traj["turns"]] == [exchange.answer["output_ids"]]
    after = 0
    samples = []
    while True:
        page = httpx.get(f"{gw.url}/samples", params={"after": after, "limit": 1000}, headers=KEY).json()
        samples += [x for x in page["samples"] if x["session_id"] == sid]
        if not page["samples"]:
            break
        after = page["cursor"]
    assert [x["tokens"] for x in samples] == [exchange.body["input_ids"] + exchange.answer["output_ids"]]


def test_client_that_never_reads_a_stream_is_cut_off(gw, proxy, engine, tok):
    s = new_session(gw)
    context = httpx.get(f"{s['base_url']}/models", headers=KEY).json()["data"][0]["max_model_len"]
    timeouts = metric(gw.url, "palaestra_gateway_streams_cut_total", reason="send_timeout")
    aborts = engine_aborts(engine.url)
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "go on forever"}],
            "max_tokens": context - 64,
            "ignore_eos": True,
            "logprobs": True,
            "stream": True,
            "logit_bias": flowing_text(tok),
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SNDBUF)  # before connecting: a small window
    sock.connect(("127.0.0.1", gw.port))
    head = _head(s["session_id"], "chat/completions", f"Content-Length: {len(body)}\r\n")
    sock.sendall(head.encode() + body)  # ... and never read

    async def hostile():  # the calm sessions run while the stream is stuck
        await asyncio.sleep(0)

    try:
        # the stuck stream stays in flight until its send timeout, however long sampling takes
        beside_calm_sessions(gw, proxy, hostile, stuck=1)

        # a few KiB of events must be sampled before a send can block (`SmallBufferServer`); an
        # answer that ended inside the buffers instead is recorded as a turn: then fail at once,
        # saying so, rather than wait for a cut that cannot come
        def cut() -> bool:
            return (
                metric(gw.url, "palaestra_gateway_streams_cut_total", reason="send_timeout") == timeouts + 1
            )

        def turns() -> list:
            return httpx.get(f"{gw.url}/sessions/{s['session_id']}", headers=KEY).json()["turns"]

        wait_for(lambda: cut() or bool(turns()), timeout_s=600)
        assert cut(), (
            f"the stream ended inside the socket buffers, never blocking a send: {len(turns())} turn(s)"
        )
        wait_for(lambda: engine_aborts(engine.url) >= aborts + 1)
        wait_for(lambda: metric(gw.url, "palaestra_gateway_in_flight_calls") == 0)
    finally:
        sock.close()
    assert httpx.get(f"{gw.url}/sessions/{s['session_id']}", headers=KEY).json()["turns"] == []
