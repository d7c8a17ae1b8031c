"""The engine side of a turn: admit -> route -> engine call -> partial continuation, streamed or whole.

`GatewayService` plans a call's prompt ids and records its turns; between the two, `EngineTurns`
gets the call's generations from the engine:

1. `admitted`: placement's admission (a new session's first call may wait for room), then the pause
   gate; the session counts the call as in flight from before the gate (`limits.IdleReaper`);
2. each engine call is routed (`routing.EngineRouting`), and its outcome is counted on the route;
   a failed call is recorded on the session (`Session.failed_calls`, the journal, /metrics);
3. an answer a weight update interrupted is continued once the gate opens (`partial.py`): the
   prompt and the kept tokens sent again with the rest of the budget, the answers joined. This loop
   (`_choice`) is written once, for streamed calls (one engine stream after another) and whole
   calls (each interrupted choice of an `n`-sample call continued on its own) alike. With routed
   experts asked (`EngineClient.routed_experts`), each call asks them from `routed_from` (the first
   position the turn's routing must cover) and a continuation from where the interrupted part's end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

from palaestra.gateway.engine_side import partial
from palaestra.gateway.engine_side.engine_client import EngineClient
from palaestra.gateway.engine_side.generation import Generation, SamplingParams
from palaestra.gateway.engine_side.pause import PauseGate
from palaestra.gateway.engine_side.routing import EngineRouting
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.metrics import GatewayMetrics
from palaestra.gateway.sessions.journal import SessionJournal
from palaestra.gateway.sessions.session import Session

__all__ = ["EngineTurns", "Piece"]

Piece = tuple[list[int], list[float], Generation | None]
"""New output ids, their logprobs, and the Generation when the piece ends an engine call (the last
piece of a choice carries the whole choice, continuations joined)."""

_Call = Callable[[Sequence[int], SamplingParams, int], AsyncIterator[Piece]]


def _max_new(sampling: SamplingParams) -> int:
    return int(sampling.get("max_new_tokens") or 0)


class EngineTurns:
    """One per gateway: the engine calls of every turn (see the module docstring)."""

    def __init__(
        self,
        engine: EngineClient,
        routing: EngineRouting,
        gate: PauseGate,
        journal: SessionJournal,
        metrics: GatewayMetrics,
    ) -> None:
        self.engine = engine
        self.routing = routing
        self.gate = gate
        self.journal = journal
        self.metrics = metrics

    @contextlib.asynccontextmanager
    async def admitted(
        self, session: Session, ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncIterator[None]:
        """Placement's admission (before the pause gate, so a weight sync never waits for it), then
        the gate. The session's calls in flight are counted from before the gate, so one waiting out a
        pause is not idle; each entry and exit restarts its idle clock."""
        await self.routing.admit(
            session.session_id, session.env, session.group_id, ids, sampling.max_new_tokens
        )
        session.busy += 1
        session.last_active = time.monotonic()
        try:
            await self.gate.enter()
        except BaseException:
            session.busy -= 1
            raise
        try:
            yield
        finally:
            session.busy -= 1
            session.last_active = time.monotonic()
            self.gate.leave()

    async def generate(
        self,
        session: Session,
        call_id: str,
        ids: Sequence[int],
        sampling: SamplingParams,
        top_logprobs: int,
        routed_from: int = 0,
    ) -> list[Generation]:
        """One whole engine call (`n` choices), each interrupted choice continued; inside `admitted`."""
        pauses = self.gate.pauses
        gens = await self._whole(session, call_id, ids, sampling, top_logprobs, routed_from)
        out = []
        for gen in gens:
            if not (gen.finish_reason.interrupted and (self.gate.paused or self.gate.pauses != pauses)):
                out.append(gen)  # what `_choice` answers for a choice not to be continued, without it
                continue
            call = self._whole_call(session, call_id, top_logprobs)
            pieces = self._choice(session, call_id, ids, sampling, routed_from, pauses, call, gen)
            async with contextlib.aclosing(pieces):
                async for _, _, final in pieces:
                    gen = final or gen
            out.append(gen)
        return out

    def stream(
        self,
        session: Session,
        call_id: str,
        ids: Sequence[int],
        sampling: SamplingParams,
        top_logprobs: int,
        routed_from: int = 0,
    ) -> AsyncIterator[Piece]:
        """One streamed choice as pieces, continued across interruptions; inside `admitted`."""
        return self._choice(
            session,
            call_id,
            ids,
            sampling,
            routed_from,
            self.gate.pauses,
            self._streamed_call(session, call_id, top_logprobs),
        )

    # -- the continuation, once ---------------------------------------------------------------
    async def _choice(
        self,
        session: Session,
        call_id: str,
        ids: Sequence[int],
        sampling: SamplingParams,
        routed_from: int,
        pauses: int,
        call: _Call,
        first: Generation | None = None,
    ) -> AsyncIterator[Piece]:
        """The pieces of one choice: `call`'s (or `first`, already answered), then, while a weight
        update interrupted the answer during the call, the continuation's (partial.py). A piece with a
        Generation ends an engine call; the last one carries the whole choice."""
        budget = sampling.max_new_tokens
        done: Generation | None = None  # what earlier engine calls of this choice sampled
        current = sampling  # the budget left to the next engine call
        while True:
            tail: tuple[list[int], list[float]] = ([], [])  # the ids of the call's final piece
            final = first
            if final is None:
                async with contextlib.aclosing(
                    # the prompt itself on the first call (a `PromptIds` stays one: EncodedIds)
                    call(ids if done is None else ids + done.output_ids, current, routed_from)
                ) as pieces:
                    async for new_ids, new_lps, end in pieces:
                        if end is None:
                            yield new_ids, new_lps, None
                        else:
                            final, tail = end, (new_ids, new_lps)
                assert final is not None  # each call ends with its Generation (or raises)
            first = None
            joined = final if done is None else partial.continued(done, final, budget)
            yield tail[0], tail[1], joined
            if not (final.finish_reason.interrupted and (self.gate.paused or self.gate.pauses != pauses)):
                return
            try:
                await self.gate.reenter()
            except GatewayError as exc:
                self._record_failure(session, call_id, exc)
                raise
            self.metrics.interrupted.inc()
            pauses = self.gate.pauses
            done = joined
            if final.routed is not None:  # the continuation's routing starts where this part's ended
                routed_from = final.routed.end
            rest = sampling.after(len(done.output_ids))
            if rest is None:  # the budget was spent at the interruption: the call ends as `length`
                yield [], [], partial.continued(done, None, budget)
                return
            current = rest

    # -- one engine call, routed ---------------------------------------------------------------
    async def _whole(
        self,
        session: Session,
        call_id: str,
        ids: Sequence[int],
        sampling: SamplingParams,
        top_logprobs: int,
        routed_from: int,
    ) -> list[Generation]:
        route = self.routing.route(
            session.session_id, session.env, session.group_id, ids, sampling.max_new_tokens
        )
        try:
            gens = await self.engine.generate(
                session.session_id, ids, sampling, top_logprobs, route, routed_from
            )
        except GatewayError as exc:
            route.failed()
            self._record_failure(session, call_id, exc)
            raise
        except BaseException:
            route.failed()
            raise
        route.done(gens[0].cached_tokens if gens else 0, sum(len(g.output_ids) for g in gens))
        return gens

    def _whole_call(self, session: Session, call_id: str, top_logprobs: int) -> _Call:
        async def call(
            ids: Sequence[int], sampling: SamplingParams, routed_from: int
        ) -> AsyncIterator[Piece]:
            gen = (await self._whole(session, call_id, ids, sampling, top_logprobs, routed_from))[0]
            yield gen.output_ids, gen.logprobs, gen

        return call

    def _streamed_call(self, session: Session, call_id: str, top_logprobs: int) -> _Call:
        async def call(
            ids: Sequence[int], sampling: SamplingParams, routed_from: int
        ) -> AsyncIterator[Piece]:
            route = self.routing.route(
                session.session_id, session.env, session.group_id, ids, sampling.max_new_tokens
            )
            final: Generation | None = None
            try:
                stream = self.engine.stream(
                    session.session_id, ids, sampling, top_logprobs, route, routed_from
                )
                async with contextlib.aclosing(stream):
                    async for new_ids, new_lps, final in stream:
                        yield new_ids, new_lps, final
                if final is None:  # the engine's stream ended without a final chunk (engine_client says why)
                    raise GatewayError(
                        "the engine's stream ended without a final chunk", 502, type="engine_error"
                    )
            except GatewayError as exc:
                route.failed()
                self._record_failure(session, call_id, exc)
                raise
            except BaseException:  # the client went away mid-stream
                route.failed()
                raise
            route.done(final.cached_tokens, len(final.output_ids))

        return call

    def ended(self, session_id: str) -> None:
        """The session takes no more calls: its engine request JSON is not kept for a next one."""
        self.engine.encoded_ids.forget(session_id)

    def _record_failure(self, session: Session, call_id: str, exc: GatewayError) -> None:
        failure = {"call_id": call_id, "status": exc.status, "message": exc.message, "time": time.time()}
        session.failed_calls.append(failure)
        self.journal.failed(session, failure)
        self.metrics.engine_errors.labels(code=exc.code or str(exc.status)).inc()
