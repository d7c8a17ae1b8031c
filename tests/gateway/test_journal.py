"""The session journal and the spool's retention, in process: torn and corrupt records, a finish
record lost after the samples were spooled, n > 1 choices, compaction, the fsync policies, and
acknowledged spool segments deleted without losing a cursor.

The engine is a TEST DOUBLE (`ScriptedEngine`, deterministic answers that end turns so they bridge);
the gateway, the tiny preset's real tokenizer and template are real. The kill -9 of a real gateway
process is tests/gateway/test_restart.py.
"""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path

import httpx
import pytest

from palaestra.gateway.engine_side.generation import FinishReason, VersionSpan
from palaestra.gateway.sessions.journal import SessionJournal
from palaestra.gateway.sessions.replay import restore
from palaestra.gateway.sessions.session import Session
from palaestra.gateway.sessions.spool import SampleSpool
from palaestra.gateway.sessions.trajectory import Turn, linearize
from tests.support.schedstat import thread_runs
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server

KEY = {"Authorization": "Bearer k-test"}


class ChoicesEngine(ScriptedEngine):
    """TEST DOUBLE: `ScriptedEngine` that also honours `sampling_params.n` (a list of answers, as
    SGLang gives), choice k scripted with index 100 * call + k."""

    def _answer(self, body, index):
        n = body.get("sampling_params", {}).get("n", 1)
        if n == 1:
            return super()._answer(body, index)
        return [ScriptedEngine._answer(self, body, 100 * index + k) for k in range(n)]


@pytest.fixture(scope="module")
def engine(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(input_ids: list[int], index: int) -> list[int]:
        return tok.encode(f"reply {len(input_ids)}.{index % 100}", add_special_tokens=False) + [end]

    double = ChoicesEngine(script, stop_ids={end})
    with ThreadServer(double.app()) as srv:
        srv.double = double  # type: ignore[attr-defined]
        yield srv


def gateway(engine, spool: Path, tok, **options) -> ThreadServer:
    return gateway_server(engine.url, spool, tok, context_length=4096, **options)


def chat(c: httpx.Client, gw, sid: str, messages: list, **extra) -> dict:
    r = c.post(f"{gw.url}/s/{sid}/v1/chat/completions", json={"messages": messages, **extra}, headers=KEY)
    assert r.status_code == 200, r.text
    return r.json()


def open_session(c: httpx.Client, gw, sid: str) -> None:
    r = c.post(f"{gw.url}/sessions", json={"env": "j", "task_id": sid, "session_id": sid}, headers=KEY)
    assert r.status_code == 200, r.text


def frames(path: Path) -> list[tuple[int, int]]:
    """(offset, end) of every record in a journal segment."""
    data, out, offset = path.read_bytes(), [], 0
    while offset < len(data):
        length, _ = struct.unpack_from("<II", data, offset)
        out.append((offset, offset + 8 + length))
        offset += 8 + length
    return out


def two_turns(c, gw, sid: str) -> list:
    messages = [{"role": "user", "content": "hi"}]
    for i in range(2):
        msg = chat(c, gw, sid, messages)["choices"][0]["message"]
        messages += [{"role": "assistant", "content": msg["content"]}, {"role": "user", "content": f"{i}"}]
    return messages


def test_torn_tail_is_dropped_and_the_rest_replays(engine, tok, tmp_path):
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=30) as c:
        open_session(c, gw, "a")
        messages = two_turns(c, gw, "a")
        before = c.get(f"{gw.url}/sessions/a", headers=KEY).json()
    (seg,) = sorted(tmp_path.glob("journal-*.log"))
    good = seg.stat().st_size
    payload = b'{"k":"turn","sid":"a","t":{"id":99'
    with open(seg, "ab") as f:  # the process died in the middle of a record
        f.write(struct.pack("<II", 500, zlib.crc32(payload)) + payload)
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=30) as c:
        assert seg.stat().st_size == good  # cut back to the last whole record
        assert c.get(f"{gw.url}/sessions/a", headers=KEY).json()["turns"] == before["turns"]
        chat(c, gw, "a", messages)  # and the session goes on, bridged
        traj = c.get(f"{gw.url}/sessions/a", headers=KEY).json()
        assert traj["forks"] == [] and traj["turns"][-1]["parent"] == traj["turns"][-2]["turn_id"]


def test_a_bad_checksum_in_the_last_record_is_torn_but_in_an_older_segment_is_an_error(tmp_path):
    journal = SessionJournal(tmp_path, fsync="off", segment_bytes=1)  # one record per segment
    journal.recover()
    for sid in ("a", "b"):
        journal.opened(Session(sid, "e", "t", "g", {}))
    journal.close()
    first, *_, last = sorted(tmp_path.glob("journal-*.log"))
    data = bytearray(last.read_bytes())
    data[-2] ^= 0xFF  # a flipped byte in the payload: the crc no longer matches
    last.write_bytes(bytes(data))
    again = SessionJournal(tmp_path, fsync="off")
    assert [r["sid"] for r in again.recover()] == ["a"] and again.torn_bytes == len(data)
    again.close()
    data = bytearray(first.read_bytes())
    data[-2] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=f"{first.name} is corrupt at byte 0"):
        SessionJournal(tmp_path, fsync="off").recover()


def test_a_lost_finish_record_is_found_in_the_spool_and_nothing_is_spooled_twice(engine, tok, tmp_path):
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=30) as c:
        open_session(c, gw, "f")
        two_turns(c, gw, "f")
        answer = c.post(f"{gw.url}/sessions/f/reward", json={"reward": 0.25}, headers=KEY).json()
    (seg,) = sorted(tmp_path.glob("journal-*.log"))
    offset, _ = frames(seg)[-1]  # the finish record: the process died before writing it
    with open(seg, "r+b") as f:
        f.truncate(offset)
    spool = SampleSpool(tmp_path)
    last_cursor = spool.last_cursor
    spool.close()
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=30) as c:
        svc = gw.server.config.app.state.service
        assert svc.recovered == {"open": 0, "finished": 0, "finished_in_spool": 1}
        traj = c.get(f"{gw.url}/sessions/f", headers=KEY).json()
        assert traj["finished"] and traj["reward"] == 0.25 and traj["sample_ids"] == answer["sample_ids"]
        again = c.post(f"{gw.url}/sessions/f/reward", json={"reward": 0.25}, headers=KEY).json()
        assert again["sample_ids"] == answer["sample_ids"] and again["cursors"] == answer["cursors"]
        assert c.get(f"{gw.url}/samples", headers=KEY).json()["last_cursor"] == last_cursor
    # and the repaired journal now says it finished
    assert b'"k":"fin"' in b"".join(p.read_bytes() for p in tmp_path.glob("journal-*.log"))


def test_n_choices_replay_and_the_agent_continues_on_the_second(engine, tok, tmp_path):
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=30) as c:
        open_session(c, gw, "n")
        messages = [{"role": "user", "content": "pick"}]
        answer = chat(c, gw, "n", messages, n=2)
        before = c.get(f"{gw.url}/sessions/n", headers=KEY).json()
        assert (
            len(before["turns"]) == 2 and before["turns"][0]["output_ids"] != before["turns"][1]["output_ids"]
        )
    text = b"".join(p.read_bytes() for p in tmp_path.glob("journal-*.log"))
    assert b'"sib":' in text  # the second choice refers to the first one's prompt
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=30) as c:
        assert c.get(f"{gw.url}/sessions/n", headers=KEY).json()["turns"] == before["turns"]
        second = answer["choices"][1]["message"]["content"]
        chat(
            c,
            gw,
            "n",
            [*messages, {"role": "assistant", "content": second}, {"role": "user", "content": "go"}],
        )
        traj = c.get(f"{gw.url}/sessions/n", headers=KEY).json()
        assert traj["turns"][-1]["parent"] == before["turns"][1]["turn_id"] and traj["forks"] == []


def test_segments_of_finished_sessions_are_deleted_oldest_first(engine, tok, tmp_path):
    with gateway(engine, tmp_path, tok, journal_segment_bytes=512) as gw, httpx.Client(timeout=30) as c:
        open_session(c, gw, "keep")  # stays open: pins the segment of its records
        chat(c, gw, "keep", [{"role": "user", "content": "x"}])
        for i in range(6):
            open_session(c, gw, f"s{i}")
            two_turns(c, gw, f"s{i}")
            c.post(f"{gw.url}/sessions/s{i}/reward", json={"reward": 1}, headers=KEY)
        svc = gw.server.config.app.state.service
        pinned = len(list(tmp_path.glob("journal-*.log")))
        assert svc.journal.segments_deleted == 0 and pinned > 3
        c.post(f"{gw.url}/sessions/keep/reward", json={"reward": 1}, headers=KEY)

        def indices() -> list[int]:
            return sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("journal-*.log"))

        current = indices()[-1]  # where "late" starts: its records pin this segment and later ones
        open_session(c, gw, "late")
        two_turns(c, gw, "late")  # writes on until the segment rotates: everything before it may go
        assert svc.journal.segments_deleted >= pinned - 1
        assert indices()[0] >= current, (current, indices())  # nothing older than "late" is kept
    with gateway(engine, tmp_path, tok) as gw:
        svc = gw.server.config.app.state.service
        assert svc.recovered["open"] == 1 and "late" in [s.session_id for s in svc.sessions.open_sessions()]


@pytest.mark.parametrize("policy", ["always", "batch", "off"])
def test_fsync_policies(tmp_path, policy):
    journal = SessionJournal(tmp_path, fsync=policy, interval_s=0.01)
    journal.recover()
    base = journal.fsyncs
    for i in range(20):
        journal.opened(Session(f"s{i}", "e", "t", "g", {"i": i}))
    if policy == "batch":  # the thread's fsync, however long this machine takes to run it
        deadline = time.monotonic() + 60
        while journal.fsyncs == base and time.monotonic() < deadline:
            time.sleep(0.01)
    written = journal.fsyncs - base
    journal.close()
    assert {"always": written == 20, "batch": 1 <= written < 20, "off": written == 0}[policy], written
    sessions, _ = restore(SessionJournal(tmp_path, fsync="off").recover(), lambda ids: "")
    assert [s.metadata["i"] for s in sessions] == list(range(20))


def test_batch_fsync_thread_sleeps_while_nothing_is_written(tmp_path):
    """The batch policy's thread fsyncs after a write and then waits for the next one: it used to
    wake every `interval_s` (here 10 ms: ~30 times in the 0.3 s watched) with nothing to do."""
    journal = SessionJournal(tmp_path, fsync="batch", interval_s=0.01)
    journal.recover()

    def fsynced(n: int) -> None:
        deadline = time.monotonic() + 60
        while journal.fsyncs < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert journal.fsyncs == n

    def wakeups() -> int:
        return thread_runs(journal._flusher.native_id)

    base = journal.fsyncs
    journal.opened(Session("a", "e", "t", "g", {}))
    fsynced(base + 1)
    before = wakeups()
    time.sleep(0.3)
    assert wakeups() - before <= 3  # finishing the last sync at most; polling: ~30
    assert journal.fsyncs == base + 1
    journal.opened(Session("b", "e", "t", "g", {}))  # a later write is fsynced as before
    fsynced(base + 2)
    journal.close()
    sessions, _ = restore(SessionJournal(tmp_path, fsync="off").recover(), lambda ids: "")
    assert [s.session_id for s in sessions] == ["a", "b"]


def test_unknown_fsync_policy_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="journal_fsync must be one of always, batch, off; got 'sometimes'"):
        SessionJournal(tmp_path, fsync="sometimes")  # type: ignore[arg-type]


def test_spool_deletes_acknowledged_segments_and_keeps_counting(tmp_path):
    spool = SampleSpool(tmp_path, segment_bytes=1)  # one append per segment
    for i in range(5):
        spool.append([{"sample_id": f"s{i}", "x": i}])
    assert len(list(tmp_path.glob("samples-*.jsonl"))) == 5
    with pytest.raises(ValueError, match="beyond the last durable cursor 5"):
        spool.ack(6)
    before = spool.bytes
    assert spool.ack(3) == 3 and spool.first_cursor == 4 and spool.bytes < before
    assert [r["cursor"] for r in spool.read(0)] == [4, 5]  # a read before the first kept starts there
    assert spool.ack(2) == 0 and spool.acked == 3  # acknowledgements only move forward
    assert spool.ack(5) == 1  # the segment being appended to stays
    spool.close()
    again = SampleSpool(tmp_path, segment_bytes=1)
    assert (again.acked, again.first_cursor, again.last_cursor) == (5, 5, 5)
    assert again.append([{"sample_id": "s5"}]) == [6]  # cursors go on after deletions and restarts
    assert again.backlog == 1
    again.read(5)
    assert again.backlog == 0
    keep = SampleSpool(tmp_path / "keep", segment_bytes=1, delete_acked=False)
    keep.append([{"sample_id": "a"}])
    keep.append([{"sample_id": "b"}])
    assert keep.ack(2) == 0 and len(list((tmp_path / "keep").glob("samples-*"))) == 2


def test_every_plain_field_of_a_session_survives(tmp_path):
    """Fields added to `Session` later (e.g. its token) are journaled without naming them here."""
    import dataclasses

    from palaestra.gateway.sessions.journal import NOT_PERSISTED

    session = Session("s", "e", "t", "g", {"k": [1, 2.5, None]})
    plain = [f for f in dataclasses.fields(Session) if f.init and f.name not in NOT_PERSISTED]
    for f in plain:
        if f.type in ("str", "str | None") and f.name != "session_id":
            setattr(session, f.name, f"value of {f.name}")
    journal = SessionJournal(tmp_path, fsync="off")
    journal.recover()
    journal.opened(session)
    journal.close()
    (restored,), _ = restore(SessionJournal(tmp_path, fsync="off").recover(), lambda ids: "")
    assert {f.name: getattr(restored, f.name) for f in plain} == {
        f.name: getattr(session, f.name) for f in plain
    }
    assert {"env", "task_id", "group_id", "metadata", "created"} <= {f.name for f in plain}


def test_an_interrupted_and_continued_turn_keeps_each_tokens_weight_version_through_replay(tmp_path):
    """A turn a weight update interrupted (v1 sampled 3 tokens, v2 the other 2) is journaled with its
    version spans: the replayed turn, its trajectory record and its sample keep every token's
    version, not only the last one (issue 37)."""
    session = Session("s", "e", "t", "g", {})
    turn = Turn(
        turn_id=1, call_id="c1", choice=0, parent=None, prompt_ids=[1, 2, 3], output_ids=[4, 5, 6, 7, 8],
        output_logprobs=[-0.1] * 5, weight_version="v2", weight_spans=[VersionSpan("v1", 0, 3), VersionSpan("v2", 3, 5)],
        finish_reason=FinishReason({"type": "length", "length": 5}), latency_s=0.0, cached_tokens=0,
        kind="completion",
    )  # fmt: skip
    journal = SessionJournal(tmp_path, fsync="off")
    journal.recover()
    journal.opened(session)
    journal.turn(session, turn)
    journal.close()
    (restored,), _ = restore(SessionJournal(tmp_path, fsync="off").recover(), lambda ids: "")
    (replayed,) = restored.turns
    assert replayed.weight_spans == turn.weight_spans
    assert replayed.summary()["weight_spans"] == [
        {"version": "v1", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": 5},
    ]
    sample = linearize(
        replayed, session_id="s", group_id="g", env="e", task_id="t", fork_index=0, reward=1.0, metrics={},
        status="completed",
    )  # fmt: skip
    assert sample.weight_versions[-5:] == ["v1", "v1", "v1", "v2", "v2"]


def test_a_failed_call_survives_and_still_marks_the_session(engine, tok, tmp_path):
    with gateway(engine, tmp_path, tok, engine_retries=0) as gw, httpx.Client(timeout=30) as c:
        open_session(c, gw, "x")
        chat(c, gw, "x", [{"role": "user", "content": "hi"}])
        engine.double.fail_next = 1
        r = c.post(
            f"{gw.url}/s/x/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a"}]},
            headers=KEY,
        )
        assert r.status_code == 503
        before = c.get(f"{gw.url}/sessions/x", headers=KEY).json()
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=30) as c:
        after = c.get(f"{gw.url}/sessions/x", headers=KEY).json()
        assert after["failed_calls"] == before["failed_calls"] and len(after["failed_calls"]) == 1
        assert (
            c.post(f"{gw.url}/sessions/x/reward", json={"reward": 1}, headers=KEY).json()["status"]
            == "failed"
        )


@pytest.mark.parametrize("depth", [240, 300, 900])
def test_deep_tool_call_arguments_are_journaled_and_replayed(engine, tok, tmp_path, depth):
    """Tool-call arguments nesting deeper than the gateway writes (orjson stops at 254 levels) are
    kept as their text, so the turn is journaled, replayed and spooled instead of a 500; shallower
    ones stay parsed (templates serialise them with `tojson`)."""
    arguments = '{"x": ' + "[" * depth + "]" * depth + "}"
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=60) as c:
        open_session(c, gw, "deep")
        first = chat(c, gw, "deep", messages, tools=tools)["choices"][0]["message"]["content"]
    with gateway(engine, tmp_path, tok) as gw, httpx.Client(timeout=60) as c:  # replayed
        svc = gw.server.config.app.state.service
        assert svc.recovered["open"] == 1
        more = [*messages, {"role": "assistant", "content": first}, {"role": "user", "content": "go"}]
        chat(c, gw, "deep", more, tools=tools)
        traj = c.get(f"{gw.url}/sessions/deep", headers=KEY).json()
        assert len(traj["turns"]) == 2 and traj["forks"] == []  # bridged onto the replayed turn
        r = c.post(f"{gw.url}/sessions/deep/reward", json={"reward": 1}, headers=KEY)
        assert r.status_code == 200 and len(r.json()["sample_ids"]) == 1, r.text


def _turn(turn_id: int, parent: Turn | None, prompt: list[int], out: list[int], call: str = "") -> Turn:
    return Turn(
        turn_id=turn_id, call_id=call or f"c{turn_id}", choice=0, parent=parent, prompt_ids=prompt,
        output_ids=out, output_logprobs=[-0.5] * len(out), weight_version="0", weight_spans=[],
        finish_reason=FinishReason({"type": "stop", "matched": out[-1]}), latency_s=0.0, cached_tokens=0,
        kind="chat",
    )  # fmt: skip


def test_a_chain_of_turns_holds_its_tokens_once_and_branches_and_siblings_their_own(tmp_path):
    """Each bridged turn appends its bridge and output to its parent's token list (a session's tokens
    are held once, not once per turn); a branch off an inner turn, another choice of the same call
    and a prompt that does not extend its parent's ids get lists of their own. Every turn's prompt,
    the samples and a journal replay are what they were with one list per turn."""
    session = Session("s", "e", "t", "g", {})
    journal = SessionJournal(tmp_path, fsync="off")
    journal.recover()
    journal.opened(session)
    t1 = _turn(1, None, [1, 2, 3], [4, 5])
    t2 = _turn(2, t1, [1, 2, 3, 4, 5, 6], [7, 8])
    t3 = _turn(3, t2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11])
    branch = _turn(4, t2, [1, 2, 3, 4, 5, 6, 7, 8, 12], [13])  # t2 already continued by t3
    sibling = _turn(5, t2, t3.prompt(), [14], call="c3")  # the second choice of t3's call
    sibling.choice = 1
    stranger = _turn(6, t3, [99, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15], [16])  # claims t3, differs at 0
    for turn in (t1, t2, t3, branch, sibling, stranger):
        session.add_turn(turn)
        if turn is not stranger:  # the journal writes a child's prompt as its parent's + a tail
            journal.turn(session, turn)
    assert t1.tokens is t2.tokens is t3.tokens and t3.tokens == [*range(1, 12)]
    assert branch.tokens is not t2.tokens and sibling.tokens is not t3.tokens
    assert stranger.tokens is not t3.tokens
    expected = {
        1: [1, 2, 3], 2: [1, 2, 3, 4, 5, 6], 3: [*range(1, 11)], 4: [1, 2, 3, 4, 5, 6, 7, 8, 12],
        5: [*range(1, 11)], 6: [99, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15],
    }  # fmt: skip
    assert {t.turn_id: t.prompt() for t in session.turns} == expected
    assert [t.end for t in session.turns] == [5, 8, 11, 10, 11, 13]
    samples = [
        linearize(t, session_id="s", group_id="g", env="e", task_id="t", fork_index=i, reward=1.0,
                  metrics={}, status="completed")
        for i, t in enumerate(session.leaves())
    ]  # fmt: skip
    assert [s.tokens for s in samples] == [
        [1, 2, 3, 4, 5, 6, 7, 8, 12, 13],
        [*range(1, 11), 14],
        [99, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 16],
    ]
    assert samples[0].loss_mask == [1, 1, 0, 1, 1, 0, 1]  # t1's and t2's outputs, the branch's
    journal.close()
    (restored,), _ = restore(SessionJournal(tmp_path, fsync="off").recover(), lambda ids: "")
    assert {t.turn_id: t.prompt() for t in restored.turns} == {k: v for k, v in expected.items() if k != 6}
    assert restored.turns[0].tokens is restored.turns[2].tokens
