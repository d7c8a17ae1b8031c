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
