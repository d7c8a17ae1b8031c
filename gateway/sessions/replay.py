"""Rebuilding sessions from the session journal's records (gateway/sessions/journal.py) at start.

    sessions, last_turn_id = restore(journal.recover(), renderer.decode)
    finish_from_spool(session, spool)   # a session whose finish record was lost after its samples

`restore` replays each session's records in order: its "open" record builds the `Session`, each
"turn" record a `Turn` (the prompt from the parent's prompt + output + the journaled tail, a fork's
from the shared prefix of its base turn + the rest; the
message digests, reply digest and context key recomputed, because Python's `hash()` differs from
one process to the next; the decoded output text from the ids; the kept Responses conversations
from the messages and the reply), "fail" records the failed calls, and a "fin" record finishes it
with the answer its reward call gave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from palaestra.gateway.engine_side.generation import FinishReason, RoutedExperts, VersionSpan
from palaestra.gateway.renderer import chain_digests, message_digest
from palaestra.gateway.sessions.session import Session
from palaestra.gateway.sessions.spool import SampleSpool
from palaestra.gateway.sessions.trajectory import Turn
from palaestra.sample import sample_id_for

__all__ = ["finish_from_spool", "journal_answer", "restore"]


@dataclass
class _Replay:
    """One session being rebuilt: its turns by id and its previous chat call's messages/digests."""

    session: Session
    turns: dict[int, Turn] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    digests: list[int] = field(default_factory=list)
    context_key: int | None = None


def restore(records: list[dict[str, Any]], decode: Any) -> tuple[list[Session], int]:
    """Sessions rebuilt from journal records (finished ones marked finished, with their answer) and
    the highest turn id seen. `decode(ids) -> str` is the renderer's (for the output text the bridge
    compares). Records of a session whose "open" record was compacted away are ignored: it finished."""
    live: dict[str, _Replay] = {}
    last_turn = 0
    for record in records:
        rep = live.get(record["sid"])
        kind = record["k"]
        if kind == "open":
            live[record["sid"]] = _Replay(Session(**record["s"]))
            continue
        if rep is None or rep.session.finished:
            continue
        if kind == "turn":
            turn = _turn(rep, record["t"])
            rep.session.add_turn(turn)
            last_turn = max(last_turn, turn.turn_id)
        elif kind == "fail":
            rep.session.failed_calls.append(record["c"])
        elif kind == "fin":
            _finish(rep.session, record["a"])
    for rep in live.values():
        if not rep.session.finished:
            for turn in rep.session.turns:
                turn.output_text = decode(turn.output_ids)
    return [rep.session for rep in live.values()], last_turn


def _turn(rep: _Replay, t: dict[str, Any]) -> Turn:
    parent = rep.turns[t["parent"]] if t["parent"] is not None else None
    context_key = rep.context_key
    if "sib" in t:
        sibling = rep.turns[t["sib"]]
        prompt, messages, digest = sibling.prompt(), rep.messages, sibling.digest
        n_messages = sibling.n_messages
    else:
        if "tail" in t:
            assert parent is not None
            prompt = parent.tokens[: parent.end] + t["tail"]
        elif "base" in t:  # a fork: the first n tokens of an earlier turn's prompt + output
            base_id, n = t["base"]
            prompt = rep.turns[base_id].tokens[:n] + t["prompt"]
        else:
            prompt = t["prompt"]
        messages, digest, n_messages = rep.messages, None, 0
        if "msgs" in t:
            k, new = t["msgs"]
            messages = rep.messages[:k] + new
            digests = rep.digests[:k] + chain_digests(new, rep.digests[k - 1] if k else 0)
            rep.messages, rep.digests = messages, digests
            digest, n_messages = (digests[-1] if digests else None), len(messages)
        if "ctx" in t:
            context_key = rep.context_key = hash(t["ctx"].encode())
    rendered = ""
    if "rtail" in t:
        assert parent is not None
        rendered = parent.rendered + t["rtail"]
    elif "rendered" in t:
        rendered = t["rendered"]
    reply = t.get("reply")
    turn = Turn(
        turn_id=t["id"],
        call_id=t["call"],
        choice=t["choice"],
        parent=parent,
        prompt_ids=prompt,
        output_ids=t["out"],
        output_logprobs=[float("-inf") if x is None else x for x in t["lp"]],  # orjson writes -inf as null
        weight_version=t["wv"],
        weight_spans=[VersionSpan.of(s) for s in t["spans"]],
        routed=RoutedExperts.from_journal(t["routed"]) if t.get("routed") else None,  # older: none
        constrained=t.get("con", False),
        finish_reason=FinishReason(t["fin"]),
        latency_s=t["lat"],
        cached_tokens=t["cached"],
        kind=t["kind"],
        n_messages=n_messages if t["kind"] == "chat" else 0,
        digest=digest if t["kind"] == "chat" else None,
        reply_digest=message_digest(reply, loose_assistant=True) if reply is not None else None,
        rendered=rendered,
        had_reasoning=t["had_r"],
        context_key=context_key if t["kind"] == "chat" else None,
        parse=t["parse"],
        controls=t.get("controls"),  # journals written before controls were recorded have none
        fork_reason=t["fork"],
        fork_detail=t["fork_detail"],
        created=t["created"],
    )
    rep.turns[turn.turn_id] = turn
    if t.get("keep") is not None and reply is not None:
        rep.session.conversations[turn.call_id] = [*messages[t["keep"] :], reply]
    return turn


def _finish(session: Session, answer: dict[str, Any]) -> None:
    leaves = sorted(session.leaves(), key=lambda t: t.turn_id)  # sample i is leaves[i]'s
    spooled = set(answer["sample_ids"])  # all but those dropped (routing that did not cover them)
    leaves = [leaf for i, leaf in enumerate(leaves) if sample_id_for(session.session_id, i) in spooled]
    session.finished, session.status, session.reward = True, answer["status"], answer["reward"]
    session.metrics = dict(answer.get("metrics") or {})
    session.sample_ids = list(answer["sample_ids"])
    session.cursors = list(answer["cursors"])
    session.sampled_tokens = int(answer["sampled_tokens"])
    session.release(leaves)  # as a live finish does: the tokens are in the spool


def journal_answer(session: Session) -> dict[str, Any]:
    """What a "fin" record holds: the finished session's reward answer and metrics."""
    return {
        "status": session.status,
        "reward": session.reward,
        "metrics": session.metrics,
        "sample_ids": session.sample_ids,
        "cursors": session.cursors,
        "sampled_tokens": session.sampled_tokens,
    }


def finish_from_spool(session: Session, spool: SampleSpool) -> bool:
    """Whether every sample of the open `session` (one per leaf, `sample_id_for(session, i)`) is in
    the spool: the process died between the spool's fsync and the finish record. If so, marks it
    finished as the spool has it (status, reward and metrics of its first sample) and returns True.
    Some but not all (a torn spool tail): it stays open, and a repeated reward appends the rest."""
    ids = [sample_id_for(session.session_id, i) for i in range(len(session.leaves()))]
    cursors = [spool.cursor_of(i) for i in ids]
    if not ids or None in cursors:
        return False
    records = [spool.read(c - 1, 1, deliver=False)[0]["sample"] for c in cursors if c is not None]
    first = records[0]
    session.finished, session.status, session.reward = True, first["status"], first["reward"]
    session.metrics = {k: v for k, v in first["metrics"].items() if k not in ("failed_calls", "turns")}
    session.sample_ids, session.cursors = ids, [c for c in cursors if c is not None]
    session.sampled_tokens = sum(sum(r["loss_mask"]) for r in records)
    session.conversations.clear()
    return True
