"""A finished session drops its token lists, and GET /sessions/{id} still answers exactly as before.

Once the reward call has spooled a session's samples, `Session.release` keeps only its turns'
summaries (gateway/sessions/finished.py) and the trajectory's ids and logprobs are read back from the
spool. Here a session with a bridged turn, a branched retry, a prefix_changed fork and a raw
completion (four samples) is read before and after its reward; the two answers must be equal.
Where the samples are gone from the spool the summaries still answer, with null token lists.
The engine is the zero-work engine (`palaestra.testing.zero`, alphabet mode: answers derived from
the session id and prompt length), the gateway and the `tiny` tokenizer are real.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from palaestra.testing.zero import make_app
from tests.support.servers import ThreadServer, gateway_server

AUTH = {"Authorization": "Bearer k-test"}


@pytest.fixture
def stack(tok, tmp_path):
    alphabet = [tok.convert_tokens_to_ids(c) for c in "abcdefgh"]
    engine = make_app(alphabet=alphabet, stop_id=tok.convert_tokens_to_ids("<|im_end|>"), reply_len=5)
    with ThreadServer(engine) as eng:
        with (
            gateway_server(eng.url, tmp_path / "spool", tok) as gw,
            httpx.Client(base_url=gw.url, headers=AUTH, timeout=60) as http,
        ):
            yield http, gw.app.state.service


def chat(http: httpx.Client, sid: str, messages: list[dict[str, Any]]) -> str:
    r = http.post(f"/s/{sid}/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_finished_session_answers_the_same_trajectory_from_the_spool(stack) -> None:
    http, service = stack
    sid = http.post("/sessions", json={"env": "test", "task_id": "t"}).json()["session_id"]
    system = {"role": "system", "content": "Answer with letters."}
    history = [system, {"role": "user", "content": "first"}]
    history.append({"role": "assistant", "content": chat(http, sid, history)})
    history.append({"role": "user", "content": "second"})
    chat(http, sid, history)  # bridged onto the first turn
    chat(http, sid, history)  # the same history again: a branched retry
    chat(http, sid, [system, {"role": "user", "content": "first, edited"}])  # prefix_changed
    r = http.post(f"/s/{sid}/v1/completions", json={"model": "tiny", "prompt": "Once upon", "max_tokens": 8})
    assert r.status_code == 200, r.text
    before = http.get(f"/sessions/{sid}").json()
    assert [f["reason"] for f in before["forks"]] == ["branched", "prefix_changed"]

    done = http.post(f"/sessions/{sid}/reward", json={"reward": 0.5}).json()
    assert len(done["sample_ids"]) == 4
    session = service.sessions.get(sid)
    assert session.packed_turns is not None and session.turns == [] and session.by_digest == {}
    assert (service.spool.backlog, service.spool.delivered) == (4, 0)
    after = http.get(f"/sessions/{sid}").json()
    # reading the samples back is not the trainer's feed: they still count in the backlog
    assert (service.spool.backlog, service.spool.delivered) == (4, 0)
    assert after["finished"] and after["sample_ids"] == done["sample_ids"]
    for key in ("turns", "forks", "parse_errors", "failed_calls"):
        assert after[key] == before[key], key
    assert sum(len(t["output_ids"]) for t in after["turns"]) == 5 * 6  # five turns of 5 letters + stop
    again = http.post(f"/sessions/{sid}/reward", json={"reward": 0.5}).json()
    assert again == done  # the reward stays idempotent once released

    # samples no longer in the spool: the summaries still answer, the token lists are null
    lost = session.trajectory(None)["turns"]
    assert all(t["prompt_ids"] is None and t["output_ids"] is None for t in lost)
    drop = ("prompt_ids", "output_ids", "output_logprobs")
    assert [{k: v for k, v in t.items() if k not in drop} for t in lost] == [
        {k: v for k, v in t.items() if k not in drop} for t in before["turns"]
    ]


def _reference_pack(turns, leaves, parse_errors, ignored):
    """`pack_turns` as it was written before `summary(lists=False)`: each turn's whole summary (its
    prompt copied), then its three token lists set to None."""
    import json

    holder: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        t = leaf
        while t is not None and t.turn_id not in holder:
            holder[t.turn_id] = i
            t = t.parent
    packed = []
    for turn in turns:
        i = holder[turn.turn_id]
        leaf = leaves[i]
        if (
            turn is not leaf
            and turn.tokens is not leaf.tokens
            and (turn.end > leaf.prompt_len or leaf.tokens[: turn.end] != turn.tokens[: turn.end])
        ):
            return None
        summary = turn.summary()
        for key in ("prompt_ids", "output_ids", "output_logprobs"):
            summary[key] = None
        packed.append((summary, i, len(turn.output_ids)))
    return json.dumps(
        {"turns": packed, "parse_errors": parse_errors, "ignored_controls": ignored}, separators=(",", ":")
    )


def test_packed_turns_are_the_summaries_without_lists_over_random_sessions() -> None:
    """`pack_turns` writes each turn's summary with `lists=False` (no copy of its prompt out of the
    session's token list): over seeded random trees of real turns (bridged chains on one token list,
    branches, `n` > 1 choices, new roots) its JSON is the one made from the whole summaries with the
    three lists set to None, byte for byte, and `summary()` still copies the prompt."""
    import random

    from palaestra.gateway.engine_side.generation import FinishReason
    from palaestra.gateway.sessions import finished
    from palaestra.gateway.sessions.trajectory import Turn

    rng = random.Random(39)
    nulled = 0
    for _ in range(60):
        turns: list[Turn] = []
        for k in range(rng.randint(1, 12)):
            out = [rng.randrange(151_000) for _ in range(rng.randint(0, 6))]
            parent = rng.choice(turns) if turns and rng.random() < 0.8 else None
            if parent is None:
                prompt = [rng.randrange(151_000) for _ in range(rng.randint(1, 9))]
            else:  # bridged (a view of the parent's list), a plain list that extends it, or one that does not
                tail = [rng.randrange(151_000) for _ in range(rng.randint(0, 4))]
                way = rng.random()
                prompt = (
                    parent.extended(tail)
                    if way < 0.6
                    else parent.tokens[: parent.end] + tail
                    if way < 0.97
                    else [7, *tail]
                )
            turns.append(
                Turn(
                    turn_id=k, call_id=f"c{k}", choice=rng.randint(0, 2), parent=parent, prompt_ids=prompt,
                    output_ids=out, output_logprobs=[rng.random() for _ in out], weight_version="v1",
                    weight_spans=[], finish_reason=FinishReason({"type": rng.choice(["stop", "length"])}),
                    latency_s=rng.random(), cached_tokens=rng.randint(0, 9), kind="chat",
                    fork_reason=None if parent else rng.choice([None, "prefix_changed"]),
                )
            )  # fmt: skip
            if parent is not None:
                parent.children += 1
        leaves = [t for t in turns if t.children == 0]
        rng.shuffle(leaves)
        packed = finished.pack_turns(turns, leaves, {"x": 1}, {})
        assert packed == _reference_pack(turns, leaves, {"x": 1}, {})
        nulled += packed is None
        for turn in turns:
            whole = turn.summary()
            assert whole["prompt_ids"] == turn.prompt() and whole["prompt_ids"] is not turn.tokens
            assert whole["output_ids"] == turn.output_ids and turn.summary(lists=False)["output_ids"] is None
    assert 0 < nulled < 60, nulled  # both answers seen: packed, and a turn whose ids are not its sample's
