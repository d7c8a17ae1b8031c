"""Forks share their prefix on disk (gateway/sessions/shared_prefix.py): the spool writes a forked
sample as a reference to an earlier sample of the same session + the shared token count + the rest,
the journal a fork's prompt against an earlier turn; every reader sees what was written before.

Checked: delta/expand give back every field (seeded random samples); a forked session's samples
read back exactly as the gateway linearized them (every field), through `/samples`, `GET
/sessions/{id}` and a restarted gateway; the stored token ids of a session forked k times, whole vs
shared; a journal with references replayed after the gateway went away mid-session; spools and
journals in the format before (whole) still read; a parent acknowledged while its child is not
stays readable; a torn child re-appended; a reference outside its segment is corruption.

The engine is the zero-work engine (`palaestra.testing.zero`, the same reply every call, tokenized
as the tokenizer does, so a fork's re-rendered history tokenizes as sampled); the gateway and the
`tiny` tokenizer are real.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from palaestra.gateway.sessions import shared_prefix
from palaestra.gateway.sessions.shared_prefix import common_prefix, delta, expand
from palaestra.gateway.sessions.spool import MAX_DEPTH, SampleSpool, read_segment
from palaestra.sample import Sample
from palaestra.testing.zero import make_app
from tests.support.servers import ThreadServer, gateway_server

AUTH = {"Authorization": "Bearer k-test"}
SYSTEM = "Follow the steps one at a time, write each result down, and say when a step is done."
REPLY = "Done: the step is carried out and its result written down."


# -- delta / expand -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 511, 512, 513, 1100])
def test_common_prefix_across_block_boundaries(n):
    a = list(range(1200))
    b = a[:n] + [-1] + a[n + 1 :]
    assert common_prefix(a, b) == n
    assert common_prefix(a, a[:n]) == n == common_prefix(a[:n], a)


def _random_sample(rng: random.Random, head: list[int], prompt_len: int, sid: str, i: int) -> dict[str, Any]:
    tokens = head + [rng.randrange(50) for _ in range(rng.randrange(0, 60))]
    prompt_len = min(prompt_len, len(tokens))
    n = len(tokens) - prompt_len
    mask = [rng.choice((0, 1, 1)) for _ in range(n)]
    sample = Sample(
        sample_id=f"{sid}-{i}",
        session_id=sid,
        group_id="g",
        env="e",
        task_id="t",
        tokens=tokens,
        prompt_len=prompt_len,
        loss_mask=mask,
        rollout_logprobs=[-rng.random() if m else 0.0 for m in mask],
        weight_versions=[rng.choice("ab") if m else "" for m in mask],
        constrained=[rng.choice((0, 1)) for _ in range(n)] if rng.random() < 0.3 else None,
        teacher_logprobs=[-rng.random() for _ in range(n)] if rng.random() < 0.3 else None,
        fork_index=i,
    )
    return sample.to_dict()


def test_delta_then_expand_gives_every_field_back():
    rng = random.Random(7)
    shared = 0
    for case in range(200):
        parent = _random_sample(rng, [rng.randrange(50) for _ in range(80)], rng.randrange(0, 100), "s", 0)
        cut = rng.randrange(0, len(parent["tokens"]) + 1)
        # a child that keeps `cut` of the parent's tokens (a fork), or all of its response lists too (a branch)
        child = _random_sample(rng, parent["tokens"][:cut], rng.randrange(0, 140), "s", 1)
        if rng.random() < 0.3 and cut >= parent["prompt_len"]:
            child = copy.deepcopy(parent) | {"sample_id": "s-1", "fork_index": 1}
            k = len(child["tokens"]) - child["prompt_len"]
            keep = rng.randrange(0, k + 1)
            for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
                child[name] = child[name][:keep]
            for name in ("constrained", "teacher_logprobs"):
                child[name] = None if child[name] is None else child[name][:keep]
            child["tokens"] = child["tokens"][: child["prompt_len"] + keep]
        found = delta(child, parent)
        if found is None:
            assert common_prefix(child["tokens"], parent["tokens"]) < shared_prefix.MIN_SHARED or (
                child["prompt_len"] < shared_prefix.MIN_SHARED
            ), case
            continue
        n, part = found
        assert child["tokens"][:n] == parent["tokens"][:n] and part["tokens"] == child["tokens"][n:]
        assert expand(json.loads(json.dumps(part)), n, parent) == child, case
        Sample.from_dict(expand(part, n, parent))  # lengths agree
        shared += 1
    assert shared > 60  # the cases exercised sharing, not only the whole fallback


# -- the gateway ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tok):
    reply = tok.encode(REPLY, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    with ThreadServer(make_app(reply_ids=reply)) as eng:
        yield eng


def chat(http: httpx.Client, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = http.post(f"/s/{sid}/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def user(i: int) -> dict[str, str]:
    return {"role": "user", "content": f"Step {i}: " + " ".join(f"note{i}-{j}" for j in range(20))}


def forked_session(http: httpx.Client, sid: str, forks: int, turns_between: int = 3) -> list[dict[str, Any]]:
    """A chat session that forks `forks` times (an edited reply, then a branched retry, then a
    compacted user message, in turn) with bridged turns between; the last messages sent."""
    r = http.post("/sessions", json={"env": "test", "task_id": "t", "session_id": sid})
    assert r.status_code == 200, r.text
    messages = [{"role": "system", "content": SYSTEM}]
    step = 0
    for k in range(forks + 1):
        if k:
            kind = ("edit", "retry", "compact")[(k - 1) % 3]
            if kind == "edit":  # the agent rewrote the model's last reply: assistant_edited
                messages[-1] = {**messages[-1], "content": "(edited) " + messages[-1]["content"]}
            elif kind == "retry":  # the last call again: branched
                messages = messages[:-1]
                chat(http, sid, messages)
                messages.append({"role": "assistant", "content": REPLY})
            else:  # the first request compacted: prefix_changed (the system message shared)
                messages[1] = {"role": "user", "content": f"(compacted {k})"}
        for _ in range(turns_between):
            messages.append(user(step))
            step += 1
            messages.append({"role": "assistant", "content": chat(http, sid, messages)["content"]})
    return messages


def spooled_records(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for seg in sorted(directory.glob("samples-*.jsonl"))
        for line in seg.read_bytes().splitlines()
    ]


def journal_turns(directory: Path) -> list[dict[str, Any]]:
    out = []
    for seg in sorted(directory.glob("journal-*.log")):
        data, offset = seg.read_bytes(), 0
        while offset < len(data):
            length = int.from_bytes(data[offset : offset + 4], "little")
            record = orjson.loads(data[offset + 8 : offset + 8 + length])
            offset += 8 + length
            if record["k"] == "turn":
                out.append(record["t"])
    return out


@pytest.fixture
def stack(tok, engine, tmp_path):
    def start(**options: Any):
        return gateway_server(engine.url, tmp_path / "spool", tok, **options)

    return start, tmp_path / "spool"


def test_a_forked_sessions_samples_read_back_as_linearized_and_share_their_prefix(stack):
    start, spool_dir = stack
    with start() as gw, httpx.Client(base_url=gw.url, headers=AUTH, timeout=60) as http:
        service = gw.app.state.service
        appended: list[dict[str, Any]] = []
        append = service.spool.append

        def capture(samples: list[dict[str, Any]]) -> list[int]:
            appended.extend(copy.deepcopy(samples))
            return append(samples)

        service.spool.append = capture
        forked_session(http, "s", forks=3)
        before = http.get("/sessions/s").json()
        assert [f["reason"] for f in before["forks"]] == ["assistant_edited", "branched", "prefix_changed"]
        done = http.post("/sessions/s/reward", json={"reward": 1.0}).json()
        assert len(done["sample_ids"]) == len(appended) == 4
        read = http.get("/samples").json()["samples"]
        assert read == appended  # every field, as linearized
        after = http.get("/sessions/s").json()  # released: the token lists come from the spool
        for key in ("turns", "forks", "parse_errors", "failed_calls"):
            assert after[key] == before[key], key
    records = spooled_records(spool_dir)
    refs = [r["ref"] for r in records if "ref" in r]
    # each fork shares its history (the compacted one: the system message)
    assert [n >= 100 for _, n in refs] == [True, True, False] and refs[2][1] >= shared_prefix.MIN_SHARED
    with start() as gw, httpx.Client(base_url=gw.url, headers=AUTH, timeout=60) as http:
        assert http.get("/samples").json()["samples"] == appended  # a restarted gateway reads the same
        replayed = http.get("/sessions/s").json()  # rebuilt from the journal, its ids from the spool
        assert replayed["finished"] and replayed["turns"] == before["turns"]


@pytest.mark.parametrize("forks", [1, 4])
def test_stored_token_ids_of_a_session_forked_k_times_whole_vs_shared(stack, forks, tmp_path):
    start, spool_dir = stack
    with start() as gw, httpx.Client(base_url=gw.url, headers=AUTH, timeout=60) as http:
        forked_session(http, "k", forks=forks)
        http.post("/sessions/k/reward", json={"reward": 1.0})
        samples = http.get("/samples").json()["samples"]
    assert len(samples) == forks + 1
    whole = SampleSpool(tmp_path / "whole", share_prefixes=False)
    whole.append(samples)
    whole.close()
    stored = {
        name: sum(len((r.get("sample") or r["part"])["tokens"]) for r in spooled_records(d))
        for name, d in (("whole", tmp_path / "whole"), ("shared", spool_dir))
    }
    # shared: each sample's tokens after the longest prefix it shares with an earlier one
    unique = sum(
        len(s["tokens"]) - max((common_prefix(s["tokens"], p["tokens"]) for p in samples[:i]), default=0)
        for i, s in enumerate(samples)
    )
    assert stored["whole"] == sum(len(s["tokens"]) for s in samples)
    assert stored["shared"] == unique < stored["whole"]
    print(f"{forks} forks: {stored['whole']} token ids stored whole, {stored['shared']} shared")


@pytest.mark.parametrize("share", [True, False], ids=["references", "whole-format-before"])
def test_a_journal_with_fork_references_replays_after_the_gateway_went_away(stack, share):
    start, spool_dir = stack
    with start() as gw, httpx.Client(base_url=gw.url, headers=AUTH, timeout=60) as http:
        gw.app.state.service.journal.share_prefixes = share  # off: the format written before
        messages = forked_session(http, "j", forks=3)
        before = http.get("/sessions/j").json()
    bases = [t for t in journal_turns(spool_dir) if "base" in t]
    # the edited reply and the compacted request; the branched retry has a parent: a tail, not a base
    assert [t["fork"] for t in bases] == (["assistant_edited", "prefix_changed"] if share else [])
    if share:  # the edited reply's prompt: its history shared, the edited message and after stored
        assert bases[0]["base"][1] > 2 * len(bases[0]["prompt"])
    with start() as gw, httpx.Client(base_url=gw.url, headers=AUTH, timeout=60) as http:
        assert gw.app.state.service.recovered["open"] == 1
        again = http.get("/sessions/j").json()
        assert again["turns"] == before["turns"] and again["forks"] == before["forks"]
        messages.append(user(99))
        chat(http, "j", messages)  # the agent goes on: bridged onto the replayed fork
        traj = http.get("/sessions/j").json()
        assert (
            traj["forks"] == before["forks"] and traj["turns"][-1]["parent"] == before["turns"][-1]["turn_id"]
        )
        assert len(http.post("/sessions/j/reward", json={"reward": 1.0}).json()["sample_ids"]) == 4


# -- the spool alone --------------------------------------------------------------------------------
def _session_samples(sid: str, forks: int, rng: random.Random) -> list[dict[str, Any]]:
    """A session's samples as forks make them: each starts with a part of the one before."""
    history = [rng.randrange(1000) for _ in range(200)]
    out = [_random_sample(rng, history, 150, sid, 0)]
    for i in range(1, forks + 1):
        head = out[-1]["tokens"][: len(out[-1]["tokens"]) - 5]
        out.append(_random_sample(rng, head, len(head), sid, i))
    return out


def test_a_spool_in_the_format_before_reads_and_new_appends_follow(tmp_path):
    rng = random.Random(1)
    old = _session_samples("old", 2, rng)
    with open(tmp_path / "samples-000001.jsonl", "w") as f:  # as the spool wrote them before
        for cursor, sample in enumerate(old, start=1):
            f.write(json.dumps({"cursor": cursor, "sample": sample}, separators=(",", ":")) + "\n")
    spool = SampleSpool(tmp_path)
    assert spool.last_cursor == 3 and [r["sample"] for r in spool.read(0)] == old
    new = _session_samples("new", 2, rng)
    assert spool.append(new) == [4, 5, 6]
    assert [r["sample"] for r in spool.read(0)] == old + new
    spool.close()
    assert ["ref" in r for r in spooled_records(tmp_path)] == [False] * 3 + [False, True, True]
    (seg,) = tmp_path.glob("samples-*.jsonl")
    assert read_segment(seg) == old + new  # the files read whole without a SampleSpool


def test_an_acknowledged_parent_stays_while_its_child_is_unacknowledged(tmp_path):
    spool = SampleSpool(tmp_path, segment_bytes=1)  # each append seals its segment
    a, b = _session_samples("a", 2, random.Random(2)), _session_samples("b", 0, random.Random(3))
    assert spool.append(a) == [1, 2, 3] and spool.append(b) == [4]
    assert spool.ack(1) == 0  # the parent is acknowledged, its children are not: nothing goes
    assert [r["sample"] for r in spool.read(1)] == a[1:] + b  # the children read whole, parents from disk
    spool.close()
    again = SampleSpool(tmp_path, segment_bytes=1)  # and after a restart, from disk alone
    assert [r["sample"] for r in again.read(2, 1)] == [a[2]]
    assert again.ack(3) == 1 and again.first_cursor == 4  # the children acknowledged: the segment goes
    assert [r["sample"] for r in again.read(0)] == b
    again.close()


def test_a_torn_child_is_cut_and_the_repeated_append_writes_it_whole(tmp_path):
    samples = _session_samples("t", 2, random.Random(4))
    spool = SampleSpool(tmp_path)
    spool.append(samples)
    spool.close()
    (seg,) = tmp_path.glob("samples-*.jsonl")
    data = seg.read_bytes()
    seg.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 20])  # the last line torn
    spool = SampleSpool(tmp_path)
    assert spool.last_cursor == 2
    assert spool.append(samples) == [1, 2, 3]  # the reward call again: only the torn one is written
    assert [r["sample"] for r in spool.read(0)] == samples
    spool.close()
    assert ["ref" in r for r in spooled_records(tmp_path)] == [False, True, False]  # its parent is older


def test_a_reference_outside_its_segment_is_corruption(tmp_path):
    spool = SampleSpool(tmp_path)
    spool.append(_session_samples("c", 1, random.Random(5)))
    spool.close()
    (seg,) = tmp_path.glob("samples-*.jsonl")
    first, second = seg.read_bytes().splitlines()
    record = json.loads(second)
    record["ref"][0] = 7
    seg.write_bytes(first + b"\n" + json.dumps(record).encode() + b"\n")
    with pytest.raises(RuntimeError, match="cursor 2 references cursor 7, which is not an earlier record"):
        SampleSpool(tmp_path)


def test_references_chain_at_most_max_depth(tmp_path):
    samples = _session_samples("d", 2 * MAX_DEPTH, random.Random(6))
    spool = SampleSpool(tmp_path)
    spool.append(samples)
    assert [r["sample"] for r in spool.read(0, 1000)] == samples
    assert [r["sample"] for r in spool.read(len(samples) - 1)] == samples[-1:]  # its whole chain from disk
    spool.close()
    depth: dict[int, int] = {}
    for r in spooled_records(tmp_path):
        depth[r["cursor"]] = depth[r["ref"][0]] + 1 if "ref" in r else 0
    assert max(depth.values()) == MAX_DEPTH  # past it, a sample references a shallower one


def test_the_journals_fork_base_is_the_full_searchs_and_stops_at_a_whole_match(tmp_path):
    """`SessionJournal._fork_base` skips leaves that cannot share more than the best so far and
    stops at the first that shares the whole prompt: on seeded random sessions it picks the turn
    the full search over every leaf picks, and a session of 400 identical forks compares one."""
    from types import SimpleNamespace

    from palaestra.gateway.sessions.journal import SessionJournal

    journal = SessionJournal(tmp_path, fsync="off")

    def full_search(turns: list, prompt: list[int], call_id: str) -> tuple[Any, int]:
        best, most = None, 0
        for other in turns:
            if other.children == 0 and other.call_id != call_id:
                n = shared_prefix.shared_with_turn(prompt, other)
                if n > most:
                    best, most = other, n
        return (best, most) if most >= shared_prefix.MIN_SHARED else (None, 0)

    rng = random.Random(7)
    for _ in range(300):
        base = [rng.randrange(4) for _ in range(rng.randrange(10, 60))]
        turns = []
        for i in range(rng.randrange(1, 12)):
            tokens = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(4) for _ in range(rng.randrange(30))
            ]
            turns.append(
                SimpleNamespace(
                    tokens=tokens,
                    end=rng.randrange(len(tokens) + 1),
                    children=rng.randrange(2),
                    call_id=f"c{i}",
                )
            )
        prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(5))]
        turn = SimpleNamespace(call_id=f"c{rng.randrange(12)}")
        session = SimpleNamespace(turns=turns)
        assert journal._fork_base(session, turn, prompt) == full_search(turns, prompt, turn.call_id)

    prompt = list(range(40))
    compared = []

    class Counted(SimpleNamespace):
        @property
        def tokens(self) -> list[int]:
            compared.append(self)
            return prompt + [7, 8]

    forks = [Counted(end=42, children=0, call_id=f"c{i}") for i in range(400)]
    assert journal._fork_base(SimpleNamespace(turns=forks), SimpleNamespace(call_id="new"), prompt) == (
        forks[0],
        40,
    )
    assert compared == [forks[0]]
    journal.close()
