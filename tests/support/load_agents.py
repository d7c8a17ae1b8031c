"""Many concurrent multi-turn chat agents against a gateway over the zero-work engine.

Used by tests/gateway/test_load.py, which then checks what the gateway recorded, and by bench/load.py,
which times the same agents (so the benchmark loads exactly what the test verifies).

The engine (`palaestra.testing.zero` in its alphabet mode) answers every call with ids derived from
the call's routing key (the session id) and its prompt length. Each agent checks, turn by turn,
that the content it received is the text of the ids the engine derives for *its* session at the
prompt length the gateway reported (`usage.prompt_tokens`): an answer meant for another session
fails at once, naming both.

One aiohttp connector serves all agents with one connection each (`limit=n`): n agents really hold
n connections to the gateway at once, which is what the file-descriptor advice in
docs/reliability-load.md is about.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from palaestra.net import ServerProcess
from palaestra.testing import zero as zero_engine
from palaestra.testing.zero import derived_reply

REPLY_LEN = 8
"""Ids per engine answer before the stop id."""

SYSTEM = (
    "You are a terse agent in a load test of the gateway. Every answer you give is one short word, "
    "with no punctuation, no explanation and no greeting. "
) * 4
"""232 tokens of the `tiny` preset: a prompt of some size, so that what a session keeps of its
tokens after it finished shows in the gateway's memory."""


@dataclass(frozen=True)
class ZeroReplies:
    """What the zero-work engine answers, and the text an agent receives for it."""

    alphabet: list[int]
    stop_id: int
    tokenizer: Any

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ZeroReplies:
        """Single-letter tokens (a-z) as the alphabet, the template's end-of-turn as the stop."""
        alphabet = [tokenizer.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"]
        return cls(alphabet, tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer)

    def ids(self, session_id: str, prompt_len: int) -> list[int]:
        return derived_reply(session_id, prompt_len, self.alphabet, REPLY_LEN, self.stop_id)

    def text(self, session_id: str, prompt_len: int) -> str:
        """The content an agent receives: the answer without its stop id."""
        return self.tokenizer.decode(self.ids(session_id, prompt_len)[:-1])

    def engine(self) -> ServerProcess:
        """The zero-work engine answering with these replies, as a subprocess on a free port."""
        flags = ["--alphabet", *map(str, self.alphabet), "--stop-id", str(self.stop_id)]
        return zero_engine.process(*flags, "--reply-len", str(REPLY_LEN))


@dataclass
class AgentRecord:
    """One agent's session as the agent saw it."""

    session_id: str
    tag: str
    """Written into every user message, so a sample holding another session's text is found."""
    prompt_lens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    """Seconds per chat call, as the agent measured them."""
    sample_ids: list[str] = field(default_factory=list)
    reconnects: int = 0
    """Requests sent again on a new connection after the gateway closed an idle one (`_post`)."""


def rss_kib(pid: int) -> int:
    """Resident memory of `pid` (VmRSS, KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def raise_fd_limit(needed: int) -> int:
    """Raises this process's soft RLIMIT_NOFILE to `needed` (children started later inherit it)
    when the hard limit allows; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def fds_needed(sessions: int) -> int:
    """Descriptors one process of a load run may hold: the gateway one per agent connection (two
    while a closed one is being replaced), up to 512 to the engine (EngineClient's pool) and its
    own files; the driver as many per agent."""
    return 2 * sessions + 512 + 512


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], record: AgentRecord
) -> tuple[int, Any]:
    """POST with the reconnect an HTTP client makes: the gateway (uvicorn) closes a connection idle
    for 5 s, and an agent that reuses it just then sees it reset before its request was read. A
    request that did reach the gateway and is sent again would show as a `branched` fork, which
    tests/gateway/test_load.py refuses, so the retry cannot hide a double generation. The reset
    shows as any of aiohttp's connection errors (ServerDisconnectedError, ClientOSError, or
    ClientConnectionResetError while the body is written), so all of them are retried."""
    for attempt in range(5):
        try:
            async with http.post(url, json=body, headers=headers) as r:
                return r.status, await r.json()
        except aiohttp.ClientConnectionError:
            if attempt == 4:
                raise
            record.reconnects += 1
    raise AssertionError("unreachable")


async def _agent(
    http: aiohttp.ClientSession,
    gateway: str,
    headers: dict[str, str],
    tag: str,
    turns: int,
    replies: ZeroReplies,
    all_created: asyncio.Event,
    created: list[int],
    n: int,
) -> AgentRecord:
    record = AgentRecord("", tag)
    status, opened = await _post(
        http, f"{gateway}/sessions", {"env": "load", "task_id": tag}, headers, record
    )
    assert status == 200, f"{tag}: POST /sessions -> {status} {opened}"
    sid, base = opened["session_id"], opened["base_url"]
    record.session_id = sid
    # a per-session key where the gateway mints one, else the run's key
    session_headers = {"Authorization": f"Bearer {opened['api_key']}"} if "api_key" in opened else headers
    created[0] += 1
    if created[0] == n:
        all_created.set()
    await all_created.wait()  # every session is open before the first chat: n concurrent sessions
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"[{tag}] turn {turn}: name a letter."})
        body = {"model": "tiny", "messages": messages, "max_tokens": REPLY_LEN + 1}
        t0 = time.perf_counter()
        status, answer = await _post(http, f"{base}/chat/completions", body, session_headers, record)
        record.latencies.append(time.perf_counter() - t0)
        assert status == 200, f"{tag} turn {turn}: {status} {answer}"
        prompt_len = answer["usage"]["prompt_tokens"]
        content = answer["choices"][0]["message"]["content"]
        expected = replies.text(sid, prompt_len)
        assert content == expected, (
            f"{tag} (session {sid}) turn {turn}: got {content!r}, its engine answer is {expected!r}"
        )
        record.prompt_lens.append(prompt_len)
        messages.append({"role": "assistant", "content": content})
    reward = {"reward": 1.0, "done": True}
    status, finished = await _post(http, f"{gateway}/sessions/{sid}/reward", reward, headers, record)
    assert status == 200, f"{tag}: reward -> {status} {finished}"
    record.sample_ids = finished["sample_ids"]
    return record


async def run_agents(
    gateway: str, headers: dict[str, str], n: int, turns: int, round_tag: str, replies: ZeroReplies
) -> tuple[list[AgentRecord], float]:
    """`n` agents at once, each opening a session, chatting `turns` turns (all sessions open before
    the first turn) and rewarding it. Returns their records and the round's wall time (seconds)."""
    timeout = aiohttp.ClientTimeout(total=600)
    all_created, created = asyncio.Event(), [0]
    t0 = time.perf_counter()
    # Pooled connections are dropped after 2 s idle, before the gateway's own 5 s, as a client
    # configured for this server would; the retries in `_post` cover the race at the margin.
    connector = aiohttp.TCPConnector(limit=n, keepalive_timeout=2)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as http:
        records = await asyncio.gather(
            *(
                _agent(http, gateway, headers, f"{round_tag}-{i}", turns, replies, all_created, created, n)
                for i in range(n)
            )
        )
    return list(records), time.perf_counter() - t0


async def peak_rss_while(pid: int, work: Any, interval_s: float = 0.02) -> tuple[Any, int]:
    """Awaits `work` while sampling `pid`'s RSS; returns its result and the highest RSS seen (KiB)."""
    peak = rss_kib(pid)
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, rss_kib(pid))
        await asyncio.wait({task}, timeout=interval_s)
    return task.result(), max(peak, rss_kib(pid))
