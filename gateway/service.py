"""The gateway's turn core, the same for every dialect: plan -> generate -> record, then finish.

`routes.py` hands each call over as its raw JSON body together with the `dialect.Dialect` its path
speaks (OpenAI chat and completions, the OpenAI Responses API, Anthropic Messages: the list is in
`dialect.py`). Per call, `GatewayService`:

1. opens the session and has the dialect's parser turn the body into a `TurnRequest` (chat) or a
   `TextRequest` (a raw text prompt);
2. plans the prompt ids: bridged onto the exact tokens of an earlier turn, or a fork with a named
   reason (`bridge.plan_chat`; text prompts: the earlier prompt + output it extends);
3. has the turn core generate it (`turns.EngineTurns`: admission, the pause gate, routing, the
   engine call, a partial rollout's continuation), whole or streamed;
4. records every sampled choice as a `trajectory.Turn` of the session's tree, after splitting
   reasoning and tool calls out of its text (`parsers.py`);
5. gives the dialect's shaper a `TurnResult`, or, streaming, a sequence of `StreamEvent`s
   (`streaming.py` decides how much text may go out before the end).

`finish` (the reward call) linearises the session's turn tree into Samples and makes them durable
in the spool. Sessions, turns, failed calls and finishes are also written to the session journal
(`journal.py`) as they happen; `recover` (called by `app.build_service`) replays it, so a gateway restarted on the
same spool directory continues every open session. New sessions pass `limits.Limits` first. No
wire format is known here: each dialect's parser and shaper live in its own modules, and
`dialect.py` says what a dialect provides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from palaestra.gateway import parse_status, parsers
from palaestra.gateway.bridge import AppendRenders, Plan, RenderGaps, plan_chat
from palaestra.gateway.config import GatewayConfig
from palaestra.gateway.dialect import (
    Dialect,
    GenerationParams,
    StreamEvent,
    StreamFailed,
    StreamFinished,
    StreamStarted,
    TextDelta,
    TextRequest,
    TokenLogprob,
    TurnOutput,
    TurnRequest,
    TurnResult,
    reply_message,
)
from palaestra.gateway.dialects import controls, template_caps
from palaestra.gateway.engine_side.generation import Generation, SamplingParams, constrained
from palaestra.gateway.engine_side.turns import EngineTurns
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.metrics import GatewayMetrics
from palaestra.gateway.renderer import ChatRenderer, message_digest
from palaestra.gateway.sessions import replay
from palaestra.gateway.sessions import sampling as session_sampling
from palaestra.gateway.sessions.journal import SessionJournal
from palaestra.gateway.sessions.limits import Limits
from palaestra.gateway.sessions.session import Session
from palaestra.gateway.sessions.session_store import SessionStore
from palaestra.gateway.sessions.spool import SampleSpool
from palaestra.gateway.sessions.trajectory import RoutingError, Turn, linearize, routing_start
from palaestra.gateway.streaming import HeldBackText, ShapedStream

log = logging.getLogger("palaestra.gateway")


@dataclass(slots=True)
class _ChatCall:
    """A planned chat call: what generating and recording it need."""

    session: Session
    request: TurnRequest
    call_id: str
    plan: Plan
    sampling: SamplingParams
    turn_extra: dict[str, Any]  # recorded on every Turn of the call
    context: bytes  # what the template reads besides the messages (its hash is the context key)


@dataclass(frozen=True)
class ModelText:
    """What the service reads off the model's tokenizer and chat template (built in `app.py`)."""

    renderer: ChatRenderer
    tool_parser: parsers.ToolCallParser
    reasoning_parser: parsers.ReasoningParser | None
    stop_text: dict[int, str]  # text of every special token: what a final stop token looks like
    render_gaps: RenderGaps  # the short rendering's probes per template arguments (None: render in full)
    append_renders: AppendRenders  # the appended path's probes per template arguments (on first need)
    caps: template_caps.TemplateCaps  # its thinking switch, where system messages go


class GatewayService:
    """The per-call core over one model's text, the engine turns and one spool (see the module doc);
    `app.build_service` wires its collaborators."""

    def __init__(
        self,
        config: GatewayConfig,
        text: ModelText,
        turns: EngineTurns,
        sessions: SessionStore,
        journal: SessionJournal,
        limits: Limits,
        spool: SampleSpool,
        metrics: GatewayMetrics,
    ):
        self.config = config
        self.renderer = text.renderer
        self.context_length = int(text.renderer.context_length or 0)
        self.tool_parser = text.tool_parser
        self.no_tool_parser = parsers.get_tool_parser("none")  # for calls with tools off
        self.reasoning_parser = text.reasoning_parser
        self.stop_text = text.stop_text
        self.render_gaps = text.render_gaps
        self.append_renders = text.append_renders
        self.caps = text.caps
        self.turns = turns
        self.gate = turns.gate
        self.routing = turns.routing
        self.sessions = sessions
        self.journal = journal
        self.limits = limits
        self.spool = spool
        self.metrics = metrics
        self.model_name = config.served_model_name or config.model
        self._turn_ids = 0
        self.recovered: dict[str, int] = {}
        self._one_token: dict[int, str] = {}  # decode([id]) of the stop ids answers ended on (`_text_of`)

    # -- the journal: what a restarted gateway continues ------------------------------------------
    def recover(self) -> dict[str, int]:
        """Rebuilds the sessions the journal holds (`replay.py`): open ones continue exactly;
        finished ones answer a repeated reward call; a session whose samples are all in the spool
        but whose finish record was lost is finished from the spool (never spooled twice)."""
        sessions, last_turn = replay.restore(self.journal.recover(), self._decode)
        self._turn_ids = max(self._turn_ids, last_turn)
        counts = {"open": 0, "finished": 0, "finished_in_spool": 0}
        for session in sessions:
            if session.finished:
                counts["finished"] += 1
            elif replay.finish_from_spool(session, self.spool):
                self.journal.finished(session.session_id, replay.journal_answer(session))
                counts["finished_in_spool"] += 1
            else:
                counts["open"] += 1
            self.sessions.adopt(session)
        self.recovered = counts
        return counts

    def create_session(
        self,
        env: str,
        task_id: str,
        group_id: str | None,
        metadata: dict[str, Any],
        session_id: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> Session:
        """A new session, if the limits admit one (429 otherwise); journaled before it is answered.
        `sampling` (checked by `session_sampling.parse`) applies to each of its calls."""
        self.limits.admit()
        session = self.sessions.create(env, task_id, group_id, metadata, session_id, sampling)
        self.journal.opened(session)
        return session

    def close(self) -> None:
        self.journal.close()

    # -- chat: plan -> generate -> record -> shape ---------------------------------------------
    async def chat(
        self,
        session_id: str,
        body: dict[str, Any],
        dialect: Dialect[TurnRequest],
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any] | ShapedStream:
        """One chat call in `dialect` (`headers`: those the dialect reads): its answer body, or its
        event stream for `stream: true`. A request refused before generation is counted on the
        session (`Session.refused`) as well as answered with the 400."""
        t0 = time.perf_counter()
        session = self.sessions.open(session_id)
        try:
            request = self._parse(session, body, dialect, headers)
            call = self._plan_chat(session, request, dialect)
        except GatewayError as exc:
            if exc.status == 400:
                session.note_refusal(dialect.name, exc)
            raise
        if dialect.stream is not None and request.params.stream:
            return ShapedStream(self._stream_chat(call, t0), functools.partial(dialect.stream, request))
        gens, engine_s = await self._generate(
            session,
            call.call_id,
            call.plan.prompt_ids,
            call.sampling,
            request.params.top_logprobs,
            routing_start(call.plan.parent),
        )
        outputs = [self._chat_output(call, i, gen, engine_s) for i, gen in enumerate(gens)]
        self.metrics.overhead.observe(max(time.perf_counter() - t0 - engine_s, 0.0))
        return dialect.answer(request, self._result(call.call_id, len(call.plan.prompt_ids), outputs))

    def _parse(
        self,
        session: Session,
        body: dict[str, Any],
        dialect: Dialect[TurnRequest],
        headers: dict[str, str] | None,
    ) -> TurnRequest:
        """The dialect's parse, with the session's kept conversation put in and the request fitted to
        the template (`controls.resolve`)."""
        args: list[Any] = [body, session.parse_memo] if dialect.takes_memo else [body]
        request = dialect.parse(*args, headers=headers) if dialect.headers else dialect.parse(*args)
        if request.params.stream and dialect.stream is None:
            raise GatewayError("streaming is not supported on this route", param="stream")
        if request.previous is not None:
            kept = session.conversations.get(request.previous)
            if kept is None:
                raise GatewayError(
                    f"Previous response with id '{request.previous}' not found in this session.",
                    400,
                    param="previous_response_id",
                )
            request.messages[request.preamble : request.preamble] = kept
        controls.resolve(request, self.caps)
        self._session_sampling(session, dialect.name, body, request.params.sampling, request.ignored)
        return request

    def _session_sampling(
        self, session: Session, route: str, body: dict[str, Any], sampling: dict[str, Any], ignored: list[str]
    ) -> None:
        """The session's sampling into the call's (gateway/sessions/sampling.py): a contradicted
        field is recorded with the call's ignored controls, counted, and logged once per session."""
        if not session.sampling:
            return
        contradicted = session_sampling.apply(session.sampling, body, sampling)
        if not contradicted:
            return
        ignored.extend(contradicted)
        for name in contradicted:
            self.metrics.sampling_contradicted.labels(route=route, control=name.split("=", 1)[0]).inc()
        if not session.sampling_warned:
            session.sampling_warned = True
            log.warning(
                "session %s (env %s): a call on %s sent %s; the session's sampling is used (the "
                "environment should pass session.sampling on every call); recorded in the session's "
                "ignored_controls, not logged again for this session",
                session.session_id,
                session.env,
                route,
                ", ".join(contradicted),
            )

    def _plan_chat(self, session: Session, request: TurnRequest, dialect: Dialect[TurnRequest]) -> _ChatCall:
        digests = session.history.of(request.messages)
        context = session.parse_memo.context(request.tools, request.template_kwargs)
        context_key = hash(context)
        plan = plan_chat(
            self.renderer,
            session.by_digest,
            bool(session.turns),
            request.messages,
            digests,
            request.tools,
            self.stop_text,
            self.config.reasoning_policy,
            request.template_kwargs,
            context_key,
            self.render_gaps.get(request.template_kwargs),
            self.append_renders,
        )
        max_tokens, clamped = self._max_tokens(request.params, len(plan.prompt_ids))
        self.metrics.prompt_tokens.inc(len(plan.prompt_ids))
        turn_controls = self._controls(dialect.name, request.ignored, clamped)
        return _ChatCall(
            session=session,
            request=request,
            call_id=f"{dialect.call_id_prefix}{secrets.token_hex(12)}",
            plan=plan,
            sampling=SamplingParams(request.params.sampling, max_tokens),
            turn_extra={
                "n_messages": len(request.messages),
                "digest": digests[-1],
                "rendered": plan.rendered,
                "fork_reason": plan.fork_reason,
                "fork_detail": plan.fork_detail,
                "context_key": context_key,
                "controls": turn_controls,
                "constrained": constrained(request.params.sampling),
            },
            context=context,
        )

    def _controls(
        self, route: str, ignored: list[str], clamped: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """What a call's turns record about its controls (`Turn.controls`): the ignored ones, each
        once, and a max_tokens clamp; each counted in /metrics."""
        out: dict[str, Any] = {}
        if ignored:
            out["ignored"] = list(dict.fromkeys(ignored))
            for name in out["ignored"]:
                self.metrics.ignored_controls.labels(route=route, control=name.split("=", 1)[0]).inc()
        if clamped is not None:
            out["max_tokens"] = clamped
            self.metrics.max_tokens_clamped.labels(route=route).inc()
        return out or None

    def _chat_output(self, call: _ChatCall, choice: int, gen: Generation, latency: float) -> TurnOutput:
        """Parses one sampled choice and records it as a turn."""
        request = call.request
        text, full = self._text_of(gen)
        parsed = parsers.parse_output(
            text,
            self.tool_parser if request.tools_on else self.no_tool_parser,
            self.reasoning_parser,
            seed=f"{call.call_id}/{choice}",
            tools_enabled=request.tools_on,
            tools=request.tools,
        )
        output = self._output(
            choice,
            gen,
            text,
            parsed.content,
            parsed.reasoning_content,
            parsed.tool_calls,
            request.params,
            request.params.top_logprobs,
        )
        status = self._parse_status(gen.output_ids, text, parsed, request.tools_on)
        reply = reply_message(output)
        kept = request.store and choice == 0
        if kept:  # what a later `previous` continues: history + reply
            call.session.conversations[call.call_id] = [*request.messages[request.preamble :], reply]
        turn = self._new_turn(
            call.session,
            call.call_id,
            choice,
            call.plan.parent,
            call.plan.prompt_ids,
            gen,
            latency,
            "chat",
            reply_digest=message_digest(reply, loose_assistant=True),
            output_text=full,
            had_reasoning=parsed.reasoning_content is not None,
            parse=status,
            **call.turn_extra,
        )
        self.journal.turn(
            call.session,
            turn,
            request.messages,
            reply,
            call.context,
            request.preamble if kept else None,
        )
        return output

    def _parse_status(
        self, ids: list[int], text: str, parsed: parsers.ParsedOutput, tools_on: bool
    ) -> dict[str, Any]:
        """How a turn's output was parsed (`parse_status.describe`); failures counted in /metrics."""
        status = parse_status.describe(
            ids, text, parsed, self.tool_parser if tools_on else None, self.reasoning_parser, self._decode
        )
        for error in status["errors"]:
            self.metrics.parse_errors.labels(reason=error["reason"]).inc()
        return status

    async def _stream_chat(self, call: _ChatCall, t0: float) -> AsyncGenerator[StreamEvent, None]:
        """The call as events: started, safe text deltas, then finished (recorded) or failed.

        `call_overhead_seconds` of a stream, as of an unstreamed call, is the time since the call
        arrived (`t0`) outside the engine: less the waits for the engine's next piece and the time
        each event spends with the consumer (shaping it and the client reading it, which an
        unstreamed call's answer is not counted for either)."""
        created = int(time.time())
        engine_s = away_s = 0.0
        text: HeldBackText | None = None  # what went out while streaming (None: nothing could)
        final: Generation | None = None
        async with self.turns.admitted(call.session, call.plan.prompt_ids, call.sampling):
            sent = time.perf_counter()
            yield StreamStarted(call.call_id, created, self.model_name, len(call.plan.prompt_ids))
            away_s += time.perf_counter() - sent
            if self.reasoning_parser is not None:
                # Reasoning comes first and is parsed at the end: no text goes out before the answer
                # is whole, so the engine answers it whole (one response, where a stream is a socket
                # read and a pass through every layer per token). The agent sees the same events.
                try:
                    asked = time.perf_counter()
                    final = await self._whole_choice(call)
                    engine_s = time.perf_counter() - asked
                except GatewayError as exc:  # recorded on the session by the turn core
                    yield StreamFailed(exc)
                    return
            else:
                params = call.request.params
                text = self._held_back(call)
                ids: list[int] = []
                pieces = self.turns.stream(
                    call.session,
                    call.call_id,
                    call.plan.prompt_ids,
                    call.sampling,
                    params.top_logprobs,
                    routing_start(call.plan.parent),
                )
                try:
                    async with contextlib.aclosing(pieces):
                        asked = time.perf_counter()
                        async for new_ids, new_lps, end in pieces:
                            engine_s += time.perf_counter() - asked
                            ids += new_ids
                            if end is not None:  # an engine call's last piece: parsed whole below
                                final = end
                            else:
                                delta = text.advance(ids)
                                if delta:
                                    lps = (
                                        self._token_logprobs(new_ids, new_lps, None, 0)
                                        if params.logprobs
                                        else None
                                    )
                                    sent = time.perf_counter()
                                    yield TextDelta(delta, lps)
                                    away_s += time.perf_counter() - sent
                            asked = time.perf_counter()
                except GatewayError as exc:  # recorded on the session by the turn core
                    yield StreamFailed(exc)
                    return
        assert final is not None
        output = self._chat_output(call, 0, final, engine_s)  # the turn's latency, as unstreamed
        result = self._result(call.call_id, len(call.plan.prompt_ids), [output], created)
        self.metrics.overhead.observe(max(time.perf_counter() - t0 - engine_s - away_s, 0.0))
        unsent = output.content or ""
        yield StreamFinished(result, unsent if text is None else text.unsent(unsent))

    async def _whole_choice(self, call: _ChatCall) -> Generation:
        """The streamed call's one choice from a whole engine call (inside `admitted`)."""
        gens = await self.turns.generate(
            call.session,
            call.call_id,
            call.plan.prompt_ids,
            call.sampling,
            call.request.params.top_logprobs,
            routing_start(call.plan.parent),
        )
        return gens[0]

    def _held_back(self, call: _ChatCall) -> HeldBackText:
        """What of the streamed text may go out: not tool-call markup or a stop string. (`<think>` is
        held by no one: with a reasoning parser a stream is answered whole (`_stream_chat`), and
        without one the answer's `<think>` is content like the rest, so holding it stalled a stream
        at the tag until the answer ended.)"""
        markers = [self.tool_parser.start_marker] if call.request.tools_on else []
        return HeldBackText(
            self._decode,
            markers,
            call.request.params.stop,
            hold_space=call.request.tools_on,
            concatenates=self.renderer.decode_concatenates,
        )

    def count_tokens(self, session_id: str, body: dict[str, Any], parse: Any) -> int:
        """Prompt tokens of a chat request as a fresh call renders them (`parse`: a dialect's parser)."""
        self.sessions.get(session_id)
        request: TurnRequest = parse(body)
        rendered = self.renderer.render(request.messages, request.tools, True, request.template_kwargs)
        return len(self.renderer.encode(rendered))

    # -- completions: a raw text prompt, bridged on the text ------------------------------------
    async def completion(
        self, session_id: str, body: dict[str, Any], dialect: Dialect[TextRequest]
    ) -> dict[str, Any]:
        session = self.sessions.open(session_id)
        request = dialect.parse(body)
        ignored: list[str] = []
        self._session_sampling(session, dialect.name, body, request.params.sampling, ignored)
        if request.params.stream:
            raise GatewayError("streaming is not supported on this route", param="stream")
        prompt = request.prompt
        parent = next(
            (t for t in reversed(session.turns) if t.kind == "completion" and prompt.startswith(t.rendered)),
            None,
        )
        if parent is not None:
            ids = parent.extended(self.renderer.encode(prompt[len(parent.rendered) :]))
            fork = None
        else:
            ids = self.renderer.encode(prompt)
            fork = "prefix_changed" if any(t.kind == "completion" for t in session.turns) else None
        max_tokens, clamped = self._max_tokens(request.params, len(ids))
        call_id = f"{dialect.call_id_prefix}{secrets.token_hex(12)}"
        sampling = SamplingParams(request.params.sampling, max_tokens)
        gens, engine_s = await self._generate(
            session, call_id, ids, sampling, request.params.top_logprobs, routing_start(parent)
        )
        outputs = []
        for i, gen in enumerate(gens):
            text, full = self._text_of(gen)
            turn = self._new_turn(
                session,
                call_id,
                i,
                parent,
                ids,
                gen,
                engine_s,
                "completion",
                rendered=prompt + full,
                output_text=full,
                constrained=constrained(request.params.sampling),
                fork_reason=fork,
                fork_detail="the prompt does not extend an earlier one" if fork else "",
                controls=self._controls(dialect.name, ignored, clamped) if i == 0 else None,
            )
            self.journal.turn(session, turn)
            # completions report no alternatives (top_logprobs: null), so none are decoded
            outputs.append(self._output(i, gen, text, text, None, [], request.params, 0))
        return dialect.answer(request, self._result(call_id, len(ids), outputs))

    # -- shared pieces --------------------------------------------------------------------------
    def _max_tokens(self, params: GenerationParams, prompt_len: int) -> tuple[int, dict[str, Any] | None]:
        """The call's max_new_tokens, and the clamp when the one asked for does not fit in the
        context with the prompt (option max_tokens_over_context: clamp it to the room left, or
        refuse with a 400 naming the field)."""
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
            if self.config.max_tokens_over_context == "clamp":
                # a JSON number past 64 bits is recorded as its digits: the journal writes int64 at most
                asked = params.max_tokens if params.max_tokens < 1 << 63 else str(params.max_tokens)
                return room, {"field": params.max_tokens_field, "asked": asked, "granted": room}
            raise GatewayError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} in "
                f"the completion: '{params.max_tokens_field}'; the gateway's option max_tokens_over_context "
                "is 'reject').",
                400,
                code="context_length_exceeded",
                param=params.max_tokens_field,
            )
        return params.max_tokens or min(room, self.config.default_max_tokens), None

    async def _generate(
        self,
        session: Session,
        call_id: str,
        ids: list[int],
        sampling: SamplingParams,
        top_logprobs: int,
        routed_from: int,
    ) -> tuple[list[Generation], float]:
        """One whole call through the turn core (`turns.py`), and its engine seconds; `routed_from`:
        the first position whose routed experts it asks (`trajectory.routing_start`)."""
        async with self.turns.admitted(session, ids, sampling):
            t0 = time.perf_counter()
            gens = await self.turns.generate(session, call_id, ids, sampling, top_logprobs, routed_from)
            return gens, time.perf_counter() - t0

    def _decode(self, ids: list[int]) -> str:
        return self.renderer.decode(ids)

    def _text_of(self, gen: Generation) -> tuple[str, str]:
        """(text for the agent, text incl. the final stop token) of a generation. An answer that ended
        on a stop token is decoded once, without it, and the token's own text appended, where the
        renderer's decode joins at whole characters (`ChatRenderer.decode_concatenates`) and the text
        ends on one: the same string as decoding all of it, at half the decoding."""
        ids = gen.output_ids
        matched = gen.finish_reason.matched
        if ids and isinstance(matched, int):
            text = self._decode(ids[:-1])
            if self.renderer.decode_concatenates and not text.endswith("\ufffd"):
                full = text + self._token_text(ids[-1])
            else:
                full = self._decode(ids)
        else:
            text = full = self._decode(ids)
        if isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text, full

    def _token_text(self, token: int) -> str:
        """decode([token]), kept for the few ids answers end on (a request's stop ids: at most 4096 kept)."""
        text = self._one_token.get(token)
        if text is None:
            text = self._decode([token])
            if len(self._one_token) < 4096:
                self._one_token[token] = text
        return text

    def _token_logprobs(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[float, int]]] | None, top_n: int
    ) -> list[TokenLogprob]:
        decode = self.renderer.decode
        out = []
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
            top = (
                [(decode([alt]), alt_lp) for alt_lp, alt in tops[i][:top_n]]
                if top_n and tops and i < len(tops)
                else []
            )
            out.append(TokenLogprob(decode([tid]), lp, top))
        return out

    def _output(
        self,
        index: int,
        gen: Generation,
        text: str,
        content: str | None,
        reasoning: str | None,
        tool_calls: list[parsers.ToolCall],
        params: GenerationParams,
        top_n: int,
    ) -> TurnOutput:
        reason = gen.finish_reason
        return TurnOutput(
            index=index,
            text=text,
            content=content,
            reasoning=reasoning,
            tool_calls=tool_calls,
            finish="tool_calls" if tool_calls else reason.kind,
            stop_matched=reason.matched,
            token_ids=gen.output_ids,
            logprobs=(
                self._token_logprobs(gen.output_ids, gen.logprobs, gen.top_logprobs, top_n)
                if params.logprobs
                else None
            ),
            weight_version=gen.weight_version,
            cached_tokens=gen.cached_tokens,
        )

    def _result(
        self, call_id: str, prompt_tokens: int, outputs: list[TurnOutput], created: int | None = None
    ) -> TurnResult:
        return TurnResult(
            call_id=call_id,
            created=int(time.time()) if created is None else created,
            model=self.model_name,
            prompt_tokens=prompt_tokens,
            outputs=outputs,
        )

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
            routed=gen.routed,
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
        self.metrics.turn_child(kind).inc()
        if turn.fork_reason:
            self.metrics.fork_child(turn.fork_reason).inc()
        if plan_parent is not None:
            self.metrics.bridged.inc()
        self.metrics.completion_tokens.inc(len(gen.output_ids))
        return turn

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
            samples, kept = [], []  # kept: the leaves whose samples go to the spool
            for i, leaf in enumerate(leaves):
                try:
                    samples.append(
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
                            routing=self.config.return_routed_experts,
                        )
                    )
                    kept.append(leaf)
                except RoutingError as exc:  # never trained on routing that is not the rollout's
                    log.warning("sample %d dropped: %s", i, exc)
                    self.metrics.samples_dropped.labels(reason="routing").inc()
            # the turns durable before their samples: a restart never finds samples of unknown turns
            await asyncio.to_thread(self.journal.sync)
            cursors = await asyncio.to_thread(self.spool.append, [s.as_record() for s in samples])
            session.finished, session.status, session.reward = True, status, reward
            session.sample_ids = [s.sample_id for s in samples]
            session.cursors = cursors
            session.sampled_tokens = sum(s.num_sampled for s in samples)
            session.release(kept)  # a finished session takes no calls; its tokens are in the spool
            self.journal.finished(session_id, {**replay.journal_answer(session), "metrics": metrics})
            self.metrics.samples.inc(len(samples))
            self.metrics.sessions_finished.labels(status=status).inc()
            self.sessions.closed(session)
            self.routing.ended(session_id)
            self.turns.ended(session_id)
            return self._finish_answer(session)

    async def trajectory(self, session_id: str) -> dict[str, Any]:
        """GET /sessions/{id}: a finished session's token lists are read back from its samples."""
        session = self.sessions.get(session_id)
        samples = None
        if session.packed_turns is not None:
            samples = await asyncio.to_thread(self._spooled, session.cursors)
        return session.trajectory(samples)

    def _spooled(self, cursors: list[int]) -> list[dict[str, Any]] | None:
        """The samples at `cursors`, or None when one is no longer in the spool (read without counting
        them delivered: a trainer has not taken them, so the backlog and `limit_backlog` still count them)."""
        try:
            records = [self.spool.read(c - 1, 1, deliver=False) for c in cursors]
        except OSError:  # a segment removed under the index
            return None
        return [r[0]["sample"] for r in records] if all(records) else None

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
