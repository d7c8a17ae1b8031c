"""Judge-model rewards (`verifiers/judge.py`): the parsers, and `Judge` against a SCRIPTED ENGINE
(a labelled TEST DOUBLE from tests/support/servers.py answering /generate with texts the test
chose) for verdicts, retries, timeouts, unreadable verdicts (recorded as failures, a zero or a drop)
and the per-verdict record; then `JudgedMathEnv` through the real gateway with a scripted policy and
a scripted judge, whose calls never reach the gateway; then the `tiny` preset served by our engine
as the judge."""

from __future__ import annotations

import asyncio
import json

import pytest

from palaestra.environments.judged.env import JudgedMathEnv
from palaestra.sdk.runner import take_tasks
from palaestra.verifiers.judge import Judge, JudgeFailed, Verdict, choice_parser, score_parser
from tests.support.servers import ScriptedEngine, TextScript, ThreadServer, gateway_server
from tests.support.sessions import rollouts


def test_parsers_read_the_last_verdict_and_refuse_what_is_not_one():
    assert score_parser()("Score: 0 ... on reflection, Score: 1") == 1.0
    assert score_parser(1, 10)("score = 7") == pytest.approx(6 / 9)
    with pytest.raises(ValueError, match="outside"):
        score_parser()("Score: 3")
    with pytest.raises(ValueError, match="no 'Score"):
        score_parser()("looks right to me")
    pick = choice_parser({"A": 1.0, "B": 0.0})
    assert pick("[[A]] no wait [[B]]") == 0.0
    with pytest.raises(ValueError, match="no choice"):
        pick("[[C]]")


def run_judge(engine, tmp_path, items, **options):
    async def go(url):
        judge = Judge(url, "tiny", record=str(tmp_path / "verdicts.jsonl"), backoff_s=0.01, **options)
        try:
            return judge, await judge.verdicts(items)
        finally:
            await judge.close()

    with ThreadServer(engine.app()) as server:
        return asyncio.run(go(server.url))


ITEM = {"question": "2+2?", "answer": "\\boxed{4}", "reference": "4"}


def by_question(tok, answers):
    """A judge script answering each prompt by the question in it (calls arrive in any order)."""
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(ids, index):
        prompt = tok.decode(ids)
        text = next(a for q, a in answers.items() if f"Question:\n{q}\n" in prompt)
        return tok.encode(text, add_special_tokens=False) + [end]

    return ScriptedEngine(script, stop_ids={end})


def test_verdicts_are_scored_recorded_and_retried(tok, tmp_path):
    engine = by_question(
        tok, {"2+2?": "It is right. Score: 1", "3+3?": "Wrong. Score: 0", "5+5?": "hmm, maybe"}
    )
    engine.fail_next = 1  # one call is answered 503 first: retried
    items = [ITEM, {**ITEM, "question": "3+3?", "session_id": "s2"}, {**ITEM, "question": "5+5?"}]
    judge, verdicts = run_judge(engine, tmp_path, items)
    assert [v.score for v in verdicts] == [1.0, 0.0, None]
    assert sum(v.attempts for v in verdicts) == 4 and verdicts[0].text == "It is right. Score: 1"
    assert verdicts[2].failure == "unparsable" and "no 'Score" in verdicts[2].reason
    prompt = tok.decode(engine.exchanges[-1].body["input_ids"])
    assert "Reference answer:\n4" in prompt and prompt.endswith("<|im_start|>assistant\n")
    lines = [json.loads(x) for x in (tmp_path / "verdicts.jsonl").read_text().splitlines()]
    by_q = {x["fields"]["question"]: x for x in lines}
    assert {q: x["score"] for q, x in by_q.items()} == {"2+2?": 1.0, "3+3?": 0.0, "5+5?": None}
    assert by_q["3+3?"]["session_id"] == "s2" and by_q["5+5?"]["verdict"] == "hmm, maybe"
    assert by_q["5+5?"]["failure"] == "unparsable"
    # a failed verdict: a recorded zero, or a drop
    assert judge.reward(verdicts[2]).value == 0.0 and judge.reward(verdicts[2]).metrics["judge/failed"] == 1.0
    assert judge.reward(verdicts[0], correct=1).metrics == {
        "judge/score": 1.0,
        "judge/failed": 0.0,
        "judge/time_s": pytest.approx(verdicts[0].seconds, abs=1e-3),
        "correct": 1.0,
    }
    dropping = Judge("http://unused", "tiny", on_failure="drop")
    with pytest.raises(JudgeFailed, match="unparsable"):
        dropping.reward(verdicts[2])


def test_a_judge_that_times_out_or_is_gone_is_a_recorded_failure(tok, tmp_path):
    script = TextScript(tok)
    slow = ScriptedEngine(script, stop_ids={script.end}, delay_s=1.0)
    _, (verdict,) = run_judge(slow, tmp_path, [ITEM], timeout_s=0.2, retries=1)
    assert verdict.failure == "timeout" and verdict.attempts == 2 and verdict.score is None
    gone = asyncio.run(Judge("http://127.0.0.1:9", "tiny", retries=0).verdict(**ITEM))
    assert gone.failure == "engine_error" and gone.score is None
    with pytest.raises(ValueError, match="needs the field 'reference'"):
        asyncio.run(Judge("http://127.0.0.1:9", "tiny").verdict(question="q", answer="a"))


def test_judged_env_through_the_gateway_keeps_the_judge_out_of_the_samples(tok, tmp_path):
    policy_script, judge_script = TextScript(tok, default=None), TextScript(tok, default=None)
    policy = ScriptedEngine(policy_script, stop_ids={policy_script.end})
    judge_engine = ScriptedEngine(judge_script, stop_ids={judge_script.end})
    with ThreadServer(policy.app()) as eng, ThreadServer(judge_engine.app()) as judge_url:
        env = JudgedMathEnv({"url": judge_url.url, "tokenizer": "tiny"})
        tasks = take_tasks(env, 2, seed=1)
        policy_script.queue += [f"\\boxed{{{tasks[0].answer}}}", "\\boxed{-999}"]
        judge_script.queue += ["Score: 1", "I cannot tell"]
        with gateway_server(eng.url, tmp_path / "spool", tok, api_key="k") as gw:
            results = rollouts(gw.url, "k", env, tasks, concurrency=1).results
    assert [r.status for r in results] == ["completed", "completed"]
    assert results[0].reward == 1.0 and results[0].metrics["judge/score"] == 1.0
    assert results[0].metrics["correct"] == 1.0
    assert results[1].reward == 0.0 and results[1].metrics["judge/failed"] == 1.0
    assert (
        len(policy.exchanges) == 2 and len(judge_engine.exchanges) == 2
    )  # the judge went straight to its engine
    judged = tok.decode(judge_engine.exchanges[0].body["input_ids"])
    assert f"\\boxed{{{tasks[0].answer}}}" in judged and tasks[0].question in judged


@pytest.mark.engine
def test_the_tiny_preset_served_by_our_engine_judges(engine, tmp_path):
    async def go():
        judge = Judge(engine.url, "tiny", max_tokens=8, record=str(tmp_path / "v.jsonl"))
        try:
            return await judge.verdicts([ITEM, ITEM])
        finally:
            await judge.close()

    verdicts = asyncio.run(go())
    # A 4M-parameter model writes no verdict: each is a recorded failure with its text, not a default.
    for v in verdicts:
        assert isinstance(v, Verdict) and v.attempts == 1 and v.text == verdicts[0].text
        assert (v.score is None) == (v.failure == "unparsable")
    assert len((tmp_path / "v.jsonl").read_text().splitlines()) == 2
