"""What the gateway does per call: plan the prompt, generate, record the turn, answer in OpenAI format.

The routes (`routes_*.py`) only parse HTTP and call `GatewayService`; everything about tokens,
turns and samples happens here and in `bridge.py` / `trajectory.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from palaestra.gateway import parsers
from palaestra.gateway.bridge import Plan, plan_chat
from palaestra.gateway.engine_client import EngineClient, Generation
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.openai_request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    GenerationParams,
    parse_generation,
)
from palaestra.gateway.renderer import (
    ChatRenderer,
    chain_digests,
    message_digest,
    normalize_messages,
    normalize_tools,
)
from palaestra.gateway.spool import SampleSpool
from palaestra.gateway.state import GatewayConfig, GatewayMetrics, PauseGate, Session, SessionStore
from palaestra.gateway.trajectory import Turn, linearize

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


class GatewayService:
    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Any,
        context_length: int,
        engine: EngineClient,
        spool: SampleSpool,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.renderer = ChatRenderer(tokenizer)
        self.engine = engine
        self.spool = spool
        self.metrics = GatewayMetrics()
        self.sessions = SessionStore(config.max_sessions, self.metrics)
        self.gate = PauseGate(config, self.metrics)
        self.model_name = config.served_model_name or config.model
        template = getattr(tokenizer, "chat_template", None) or ""
        auto_tool, auto_reason = parsers.detect_parsers(template if isinstance(template, str) else "")
        self.tool_parser = parsers.get_tool_parser(
            auto_tool if config.tool_parser == "auto" else config.tool_parser
        )
        self.reasoning_parser = parsers.get_reasoning_parser(
            auto_reason if config.reasoning_parser == "auto" else config.reasoning_parser
        )
        self.stop_text = self._stop_texts()
        self._turn_ids = 0

    def _stop_texts(self) -> dict[int, str]:
        """Text of every special token: what a model's final stop token looks like in the template."""
        out: dict[int, str] = {}
        for tid in getattr(self.tokenizer, "all_special_ids", []) or []:
            out[int(tid)] = self.tokenizer.convert_ids_to_tokens(int(tid))
        for tid, tok in (getattr(self.tokenizer, "added_tokens_decoder", {}) or {}).items():
            out.setdefault(int(tid), str(tok))
        return out

    # -- shared pieces --------------------------------------------------------------------------
    def _max_tokens(self, params: GenerationParams, prompt_len: int) -> int:
        room = self.context_length - prompt_len
        if room < 1:
            raise GatewayError(
                f"This model's maximum context length is {self.context_length} tokens. However, your messages "
                f"resulted in {prompt_len} tokens.",
                400,
                code="context_length_exceeded",
                param="messages",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise GatewayError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} in "
                f"the completion).",
                400,
                code="context_length_exceeded",
                param="max_tokens",
            )
        return params.max_tokens or min(room, self.config.default_max_tokens)

    def _new_turn(
        self,
        session: Session,
        call_id: str,
        choice: int,
        plan_parent: Turn | None,
        prompt_ids: list[int],
        gen: Generation,
        latency: float,
        kind: str,
        **extra: Any,
    ) -> Turn:
        self._turn_ids += 1
        turn = Turn(
            turn_id=self._turn_ids,
            call_id=call_id,
            choice=choice,
            parent=plan_parent,
            prompt_ids=prompt_ids,
            output_ids=gen.output_ids,
            output_logprobs=gen.logprobs,
            weight_version=gen.weight_version,
            weight_spans=gen.weight_versions,
            finish_reason=gen.finish_reason,
            latency_s=latency,
            cached_tokens=gen.cached_tokens,
            kind=kind,
            **extra,
        )
        if plan_parent is not None and plan_parent.children > 0 and turn.fork_reason is None:
            turn.fork_reason, turn.fork_detail = (
                "branched",
                f"turn {plan_parent.turn_id} already had a continuation",
            )
        session.add_turn(turn)
        self.metrics.turns.labels(kind=kind).inc()
        if turn.fork_reason:
            self.metrics.forks.labels(reason=turn.fork_reason).inc()
        if plan_parent is not None:
            self.metrics.bridged.inc()
        self.metrics.completion_tokens.inc(len(gen.output_ids))
        return turn

    def _record_failure(self, session: Session, call_id: str, exc: GatewayError) -> None:
        session.failed_calls.append(
            {"call_id": call_id, "status": exc.status, "message": exc.message, "time": time.time()}
        )
        self.metrics.engine_errors.labels(code=exc.code or str(exc.status)).inc()

    async def _generate(
        self, session: Session, call_id: str, ids: list[int], sampling: dict[str, Any], top_logprobs: int
    ) -> tuple[list[Generation], float]:
        """One non-streaming engine call behind the pause gate; a failure is recorded on the session."""
        await self.gate.enter()
        try:
            t0 = time.perf_counter()
            try:
                gens = await self.engine.generate(session.session_id, ids, sampling, top_logprobs)
            except GatewayError as exc:
                self._record_failure(session, call_id, exc)
                raise
            return gens, time.perf_counter() - t0
        finally:
            self.gate.leave()

    def _text_of(self, gen: Generation) -> tuple[str, str]:
        """(text for the agent, text incl. the final stop token) of a generation."""
        ids = gen.output_ids
        reason = gen.finish_reason
        body_ids = (
            ids[:-1]
            if ids and reason.get("type") == "stop" and isinstance(reason.get("matched"), int)
            else ids
        )
        text = self.tokenizer.decode(body_ids, skip_special_tokens=False)
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            cut = text.find(reason["matched"])
            if cut >= 0:
                text = text[:cut]
        return text, self.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprobs(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[float, int]]] | None, top_n: int
    ) -> dict[str, Any]:
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
            tok = self.tokenizer.decode([tid])
            entry: dict[str, Any] = {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode()),
                "top_logprobs": [],
            }
            if top_n and tops and i < len(tops):
                for alt_lp, alt in tops[i][:top_n]:
                    alt_tok = self.tokenizer.decode([alt])
                    entry["top_logprobs"].append(
                        {"token": alt_tok, "logprob": alt_lp, "bytes": list(alt_tok.encode())}
                    )
            content.append(entry)
        return {"content": content, "refusal": None}

    @staticmethod
    def _usage(prompt_len: int, completion: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- chat -----------------------------------------------------------------------------------
    def _plan_chat(
        self, session: Session, body: dict[str, Any]
    ) -> tuple[Plan, list[dict], list[int], Any, Any]:
        messages = normalize_messages(body.get("messages"))
        tools = normalize_tools(body.get("tools"))
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if not tools or name not in {t["function"]["name"] for t in tools}:
                raise GatewayError(
                    f"tool_choice names a function not in 'tools': {name!r}", param="tool_choice"
                )
        elif tool_choice not in ("auto", "none", "required"):
            raise GatewayError(
                "tool_choice must be 'auto', 'none', 'required' or a named function", param="tool_choice"
            )
        if tool_choice == "required" and not tools:
            raise GatewayError("tool_choice 'required' needs 'tools'", param="tool_choice")
        extra = body.get("chat_template_kwargs") or None
        if extra is not None and not isinstance(extra, dict):
            raise GatewayError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        digests = chain_digests(messages)
        plan = plan_chat(
            self.renderer,
            session.by_digest,
            bool(session.turns),
            messages,
            digests,
            tools,
            self.stop_text,
            self.config.reasoning_policy,
            extra,
        )
        return plan, messages, digests, tools, tool_choice

    def _parse(
        self, text: str, seed: str, tools: list[dict[str, Any]] | None, tools_on: bool
    ) -> parsers.ParsedOutput:
        return parsers.parse_output(
            text,
            self.tool_parser if tools_on else parsers.get_tool_parser("none"),
            self.reasoning_parser,
            seed=seed,
            tools_enabled=tools_on,
            tools=tools,
        )

    @staticmethod
    def _message(parsed: parsers.ParsedOutput) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
        if parsed.reasoning_content is not None:
            msg["reasoning_content"] = parsed.reasoning_content
        return msg

    def _reply_digest(self, msg: dict[str, Any]) -> int:
        return message_digest(normalize_messages([msg])[0], loose_assistant=True)

    def _chat_turn(
        self,
        session: Session,
        call_id: str,
        choice: int,
        plan: Plan,
        gen: Generation,
        latency: float,
        tools: list[dict[str, Any]] | None,
        tools_on: bool,
        turn_extra: dict[str, Any],
    ) -> tuple[parsers.ParsedOutput, dict[str, Any]]:
        """Parses one sampled choice into an assistant message and records it as a turn."""
        text, full = self._text_of(gen)
        parsed = self._parse(text, f"{call_id}/{choice}", tools, tools_on)
        msg = self._message(parsed)
        self._new_turn(
            session,
            call_id,
            choice,
            plan.parent,
            plan.prompt_ids,
            gen,
            latency,
            "chat",
            reply_digest=self._reply_digest(msg),
            output_text=full,
            had_reasoning=parsed.reasoning_content is not None,
            **turn_extra,
        )
        return parsed, msg

    async def chat(self, session_id: str, body: dict[str, Any]) -> dict[str, Any] | AsyncIterator[str]:
        t0 = time.perf_counter()
        session = self.sessions.open(session_id)
        params = parse_generation(body, CHAT_FIELDS, chat=True)
        plan, messages, digests, tools, tool_choice = self._plan_chat(session, body)
        max_tokens = self._max_tokens(params, len(plan.prompt_ids))
        sampling = {**params.sampling, "max_new_tokens": max_tokens}
        call_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        tools_on = bool(tools) and tool_choice != "none"
        turn_extra = {
            "n_messages": len(messages),
            "digest": digests[-1],
            "rendered": plan.rendered,
            "fork_reason": plan.fork_reason,
            "fork_detail": plan.fork_detail,
        }
        self.metrics.prompt_tokens.inc(len(plan.prompt_ids))
        if params.stream:
            return self._chat_stream(
                session, params, plan, sampling, call_id, tools, tools_on, turn_extra, t0
            )
        gens, engine_s = await self._generate(
            session, call_id, plan.prompt_ids, sampling, params.top_logprobs
        )
        choices = []
        for i, gen in enumerate(gens):
            parsed, msg = self._chat_turn(
                session, call_id, i, plan, gen, engine_s, tools, tools_on, turn_extra
            )
            finish = "tool_calls" if parsed.tool_calls else FINISH.get(gen.finish_reason.get("type"), "stop")
            choice: dict[str, Any] = {"index": i, "message": msg, "finish_reason": finish, "logprobs": None}
            if params.logprobs:
                choice["logprobs"] = self._logprobs(
                    gen.output_ids, gen.logprobs, gen.top_logprobs, params.top_logprobs
                )
            choices.append(choice)
        self.metrics.overhead.observe(max(time.perf_counter() - t0 - engine_s, 0.0))
        return {
            "id": call_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "system_fingerprint": gens[0].weight_version,
            "usage": self._usage(
                len(plan.prompt_ids), sum(len(g.output_ids) for g in gens), gens[0].cached_tokens
            ),
        }

    async def _chat_stream(
        self,
        session: Session,
        params: GenerationParams,
        plan: Plan,
        sampling: dict[str, Any],
        call_id: str,
        tools: list[dict[str, Any]] | None,
        tools_on: bool,
        turn_extra: dict[str, Any],
        t0: float,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(
            delta: dict[str, Any] | None,
            finish: str | None = None,
            logprobs: Any = None,
            usage: dict[str, Any] | None = None,
        ) -> str:
            body: dict[str, Any] = {
                "id": call_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [],
            }
            if delta is not None:
                body["choices"] = [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
                ]
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        await self.gate.enter()
        try:
            yield chunk({"role": "assistant", "content": ""})
            ids: list[int] = []
            lps: list[float] = []
            sent_text = ""
            holdback_markers = [
                m for m in (self.tool_parser.start_marker if tools_on else "", "<think>") if m
            ]
            final: Generation | None = None
            reasoning_mode = self.reasoning_parser is not None
            try:
                async for new_ids, new_lps, fin in self.engine.stream(
                    session.session_id, plan.prompt_ids, sampling, params.top_logprobs
                ):
                    ids += new_ids
                    lps += new_lps
                    final = fin
                    if fin is not None or reasoning_mode:
                        continue  # the final chunk is parsed whole below; reasoning models are parsed at the end
                    text = self.tokenizer.decode(ids, skip_special_tokens=False)
                    safe = _safe_prefix(text, holdback_markers, params.stop)
                    if len(safe) > len(sent_text) and safe.startswith(sent_text):
                        delta_lp = self._logprobs(new_ids, new_lps, None, 0) if params.logprobs else None
                        yield chunk({"content": safe[len(sent_text) :]}, logprobs=delta_lp)
                        sent_text = safe
            except GatewayError as exc:
                self._record_failure(session, call_id, exc)
                yield f"data: {json.dumps(exc.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            self.gate.leave()
        assert final is not None
        parsed, _ = self._chat_turn(session, call_id, 0, plan, final, 0.0, tools, tools_on, turn_extra)
        if parsed.reasoning_content is not None:
            yield chunk({"reasoning_content": parsed.reasoning_content})
        content = parsed.content or ""
        # what was streamed already cannot be taken back: send only what extends it
        rest = content[len(sent_text) :] if content.startswith(sent_text) else ""
        if rest:
            yield chunk({"content": rest})
        if parsed.tool_calls:
            yield chunk(
                {
                    "tool_calls": [
                        {
                            "index": j,
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for j, c in enumerate(parsed.tool_calls)
                    ]
                }
            )
        finish = "tool_calls" if parsed.tool_calls else FINISH.get(final.finish_reason.get("type"), "stop")
        yield chunk({}, finish)
        if params.include_usage:
            yield chunk(
                None, usage=self._usage(len(plan.prompt_ids), len(final.output_ids), final.cached_tokens)
            )
        yield "data: [DONE]\n\n"

    # -- completions ----------------------------------------------------------------------------
    async def completion(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        session = self.sessions.open(session_id)
        params = parse_generation(body, COMPLETION_FIELDS, chat=False)
        if params.stream:
            raise GatewayError("streaming is supported on /chat/completions only", param="stream")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise GatewayError("'prompt' must be a non-empty string", param="prompt")
        parent = next(
            (t for t in reversed(session.turns) if t.kind == "completion" and prompt.startswith(t.rendered)),
            None,
        )
        if parent is not None:
            ids = parent.prompt_ids + parent.output_ids + self.renderer.encode(prompt[len(parent.rendered) :])
            fork = None
        else:
            ids = self.renderer.encode(prompt)
            fork = "prefix_changed" if any(t.kind == "completion" for t in session.turns) else None
        max_tokens = self._max_tokens(params, len(ids))
        call_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        sampling = {**params.sampling, "max_new_tokens": max_tokens}
        gens, engine_s = await self._generate(session, call_id, ids, sampling, params.top_logprobs)
        choices = []
        for i, gen in enumerate(gens):
            text, full = self._text_of(gen)
            self._new_turn(
                session,
                call_id,
                i,
                parent,
                ids,
                gen,
                engine_s,
                "completion",
                rendered=prompt + self.tokenizer.decode(gen.output_ids, skip_special_tokens=False),
                output_text=full,
                fork_reason=fork,
                fork_detail="the prompt does not extend an earlier one" if fork else "",
            )
            choice: dict[str, Any] = {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": FINISH.get(gen.finish_reason.get("type"), "stop"),
            }
            if params.logprobs:
                toks = [self.tokenizer.decode([t]) for t in gen.output_ids]
                choice["logprobs"] = {
                    "tokens": toks,
                    "token_logprobs": gen.logprobs,
                    "top_logprobs": None,
                    "text_offset": [sum(len(x) for x in toks[:j]) for j in range(len(toks))],
                }
            choices.append(choice)
        return {
            "id": call_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(len(ids), sum(len(g.output_ids) for g in gens), gens[0].cached_tokens),
        }

    # -- rewards --------------------------------------------------------------------------------
    async def finish(
        self, session_id: str, reward: float, metrics: dict[str, float], status: str
    ) -> dict[str, Any]:
        session = self.sessions.get(session_id)
        async with session.finish_lock:
            if session.finished:  # idempotent: the same answer again
                return self._finish_answer(session)
            if status == "completed" and session.failed_calls:
                status = "failed"  # an engine call failed: the trajectory may be incomplete
            leaves = sorted(session.leaves(), key=lambda t: t.turn_id)
            samples = [
                linearize(
                    leaf,
                    session_id=session.session_id,
                    group_id=session.group_id,
                    env=session.env,
                    task_id=session.task_id,
                    fork_index=i,
                    reward=reward,
                    metrics={**metrics, "failed_calls": float(len(session.failed_calls))},
                    status=status,
                )
                for i, leaf in enumerate(leaves)
            ]
            cursors = await asyncio.to_thread(self.spool.append, [s.to_dict() for s in samples])
            session.finished, session.status, session.reward = True, status, reward
            session.sample_ids = [s.sample_id for s in samples]
            session.cursors = cursors
            session.sampled_tokens = sum(s.num_sampled for s in samples)
            for turn in session.turns:  # only bridging needed these; a finished session takes no calls
                turn.rendered = turn.output_text = ""
            self.metrics.samples.inc(len(samples))
            self.metrics.sessions_finished.labels(status=status).inc()
            self.metrics.active.dec()
            return self._finish_answer(session)

    @staticmethod
    def _finish_answer(session: Session) -> dict[str, Any]:
        return {
            "session_id": session.session_id,
            "status": session.status,
            "reward": session.reward,
            "sample_ids": session.sample_ids,
            "cursors": session.cursors,
            "sampled_tokens": session.sampled_tokens,
            "durable": True,
        }


def _safe_prefix(text: str, markers: list[str], stops: list[str]) -> str:
    """The part of streamed text that can go out now: not a partial UTF-8 char, tool-call markup or stop string."""
    cut = len(text)
    while cut and text[cut - 1] == "\ufffd":
        cut -= 1
    for marker in markers:
        pos = text.find(marker)
        if pos >= 0:
            cut = min(cut, pos)
        for k in range(len(marker) - 1, 0, -1):  # a marker may be arriving
            if text[:cut].endswith(marker[:k]):
                cut -= k
                break
    for s in stops:
        pos = text.find(s)
        if pos >= 0:
            cut = min(cut, pos)
        for k in range(len(s) - 1, 0, -1):
            if text[:cut].endswith(s[:k]):
                cut -= k
                break
    return text[:cut]
