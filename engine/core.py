"""The embedded engine's scheduler: continuous batching on one thread that owns the model.

Requests arrive from the HTTP layer (any thread) through `submit`; control operations (abort,
pause, continue, flush, weight updates) are queued and executed by the scheduler thread between
steps, so the model and the KV buffers are only ever touched by one thread. Each loop iteration:

1. runs queued control operations and pending aborts;
2. (unless paused or a weight update waits for idle) admits waiting requests: prefill on top of the
   longest prefix-cache hit, then samples their first token;
3. runs one batched decode step for every running sequence.

Semantics follow SGLang (docs/engine-protocol.md, "Control" and "Weight sync"): aborted requests
finish with `finish_reason.type == "abort"` and keep their partial output; while paused, new
requests wait; a weight update when not paused waits for the running requests to finish;
`weight_version` changes only when an update succeeds.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from palaestra.engine.grammar import Grammars
from palaestra.engine.lora import NOT_ENABLED, LoraManager
from palaestra.engine.metrics import EngineMetrics
from palaestra.engine.model_runner import ModelRunner, SeqKV
from palaestra.engine.prefix_cache import PrefixCache
from palaestra.engine.protocol import PromptSpec, RequestError
from palaestra.engine.sampling import RowState, log_softmax, sample

log = logging.getLogger("palaestra.engine")

Notify = Callable[["EngineRequest", int, bool], None]  # (request, number of output tokens, finished)


@dataclass
class EngineRequest:
    """One prompt of a /generate call, waiting or being generated: its spec, its sampling generator
    and everything produced so far (output ids, logprobs, finish reason). The scheduler thread is
    its only writer; the HTTP layer reads it when `notify` says it progressed."""

    spec: PromptSpec
    notify: Notify
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    output_ids_lp: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_ids_lp: list[list[tuple[float, int]] | None] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    trimmed_text: str | None = None  # text cut at a matched stop string
    version_spans: list[list[Any]] = field(default_factory=list)  # [version, start, end]
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    abort_message: str | None = None
    row: int | None = None
    constraint: Any = None  # engine.grammar.Constraint of a json_schema / regex / ebnf request
    adapter: Any = None  # engine.lora.LoraAdapter named by lora_path (None: the base model)
    routing: torch.Tensor | None = None  # MoE, when asked: int32 [forwarded tokens, layers, top_k]

    @property
    def rid(self) -> str:
        return self.spec.rid


@dataclass
class _Control:
    fn: Callable[[], Any]
    future: Future
    needs_idle: bool = False  # weight updates wait until no request runs (unless paused)


class Engine:
    """Owns the model, the running batch, the prefix cache and the scheduler thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        eos_token_ids: Iterable[int],
        max_running_requests: int = 64,
        prefill_token_budget: int = 4096,
        prefix_cache_bytes: int = 1 << 30,
        weight_version: str = "default",
        metrics: EngineMetrics | None = None,
        lora: LoraManager | None = None,
    ):
        self.runner = ModelRunner(model)
        self.lora = lora  # resident LoRA adapters (engine/lora.py); None: served without LoRA
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.grammars = Grammars(tokenizer, self.eos_token_ids)
        self.max_running_requests = max_running_requests
        self.prefill_token_budget = prefill_token_budget
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.weight_version = weight_version
        self.metrics = metrics or EngineMetrics()
        if self.runner.routing is not None:
            routing = self.runner.routing
            self.metrics.watch_expert_load(lambda: routing.load.clone().tolist())
        self.batch = self.runner.new_batch()
        self.running: list[EngineRequest] = []  # index == row in self.batch
        self.waiting: deque[EngineRequest] = deque()
        self.paused = False
        self.shared_weights = None  # set by a load_format "mmap" update: the file the weights live in
        self._incoming: list[EngineRequest] = []
        self._controls: deque[_Control] = deque()
        self._aborts: list[tuple[str, bool, str]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # -- called from any thread ---------------------------------------------------------------
    def submit(self, specs: list[PromptSpec], notify: Notify) -> list[EngineRequest]:
        seqs = []
        for spec in specs:
            gen = torch.Generator()
            if spec.params.sampling_seed is not None:
                gen.manual_seed(spec.params.sampling_seed)
            else:
                gen.seed()
            seq = EngineRequest(spec=spec, notify=notify, generator=gen)
            seq.constraint = self.grammars.constraint(spec.params)  # a bad grammar is the caller's 400
            if spec.lora_path is not None:  # resolved now: an unknown adapter is the caller's 400
                if self.lora is None:
                    raise RequestError(f"lora_path {spec.lora_path!r} names an adapter, but {NOT_ENABLED}")
                seq.adapter = self.lora.get(spec.lora_path)
            seqs.append(seq)
        with self._cond:
            live = (
                {s.rid for s in self.running}
                | {s.rid for s in self.waiting}
                | {s.rid for s in self._incoming}
            )
            dup = [s.rid for s in seqs if s.rid in live]
            if dup:
                raise RequestError(f"duplicate request id {dup[0]!r}: a request with this rid is in flight")
            self._incoming.extend(seqs)
            self.metrics.waiting.set(len(self.waiting) + len(self._incoming))
            self._cond.notify()
        return seqs

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Abort requested") -> None:
        """Aborts in-flight requests whose rid starts with `rid` (SGLang matches by prefix)."""
        if not rid and not abort_all:
            return
        with self._cond:
            self._aborts.append((rid, abort_all, message))
            self._cond.notify()

    def call(self, fn: Callable[[], Any], needs_idle: bool = False) -> Future:
        """Runs `fn` on the scheduler thread between steps; returns a concurrent Future."""
        fut: Future = Future()
        with self._cond:
            self._controls.append(_Control(fn, fut, needs_idle))
            self._cond.notify()
        return fut

    def in_flight(self) -> int:
        with self._cond:
            return len(self.running) + len(self.waiting) + len(self._incoming)

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- control operations (run on the scheduler thread via `call`) --------------------------
    def pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort_matching("", True, "Generation paused (abort mode)")
        self.paused = True
        self.metrics.paused.set(1)

    def resume(self) -> None:
        self.paused = False
        self.metrics.paused.set(0)

    def flush(self) -> bool:
        if self.running or self.waiting or self._incoming:
            return False
        self.prefix_cache.clear()
        return True

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copies HF-named tensors into the model; validates everything before changing anything."""
        params = self.runner.named_tensors()
        updates = []
        for name, tensor in named:
            if name not in params:
                raise RequestError(f"unknown parameter {name!r} for this model")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise RequestError(
                    f"shape mismatch for {name}: got {tuple(tensor.shape)}, model has {tuple(params[name].shape)}"
                )
            updates.append((params[name], tensor))
        if not updates:
            raise RequestError("no tensors in the update")
        self._base_weights_change()
        with torch.inference_mode(False), torch.no_grad():  # parameters are normal tensors
            for param, tensor in updates:
                param.copy_(tensor.to(param.dtype))
        return len(updates)

    def load_weights_from_file(self, path: str, share: bool = False) -> int:
        """Safetensors at `path` into the model: read straight into the parameters
        (`weights.load_safetensors_into`), or with `share` the parameters become the file's mapped
        bytes (`weights.SharedSafetensors`; load_format "mmap")."""
        from palaestra.engine.weights import SharedSafetensors, load_safetensors_into, safetensors_names

        self._base_weights_change()  # before: a load that fails half-way has changed some
        # Shared, the parameters become the file's bytes: only whole tensors under the model's own
        # names (an MoE's fused expert tensors, not the per-expert views) can be shared. A file
        # under per-expert names (the trainer's, a checkpoint's) is copied instead.
        params = dict(self.runner.model.named_parameters())
        params.update(dict(self.runner.model.named_buffers()))
        if not share or not safetensors_names(path) <= params.keys():
            return load_safetensors_into(path, self.runner.named_tensors())
        if self.shared_weights is None:
            self.shared_weights = SharedSafetensors()
        return self.shared_weights.share(path, params)

    def _base_weights_change(self) -> None:
        if self.lora is not None:  # an adapter's base checksum is checked against the new weights
            self.lora.weights_changed()

    def requests_using(self, adapter: Any) -> int:
        """How many requests in flight hold `adapter` (an unload waits for none)."""
        with self._cond:
            return sum(s.adapter is adapter for s in (*self.running, *self.waiting, *self._incoming))

    def _adapters(self, seqs: list[EngineRequest]):
        """The LoRA rows of the next forward passes (engine/lora.py); nothing without LoRA."""
        return self.lora.rows([s.adapter for s in seqs]) if self.lora is not None else nullcontext()

    @staticmethod
    def _cache_key(seq: EngineRequest) -> int | None:
        return seq.adapter.uid if seq.adapter is not None else None

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version
        self.metrics.set_weight_version(version)

    # -- scheduler thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        # Everything the scheduler creates (KV buffers, cache entries) is an inference tensor.
        with torch.inference_mode():
            while self._step():
                pass

    def _step(self) -> bool:
        with self._cond:
            while not self._stop and not self._has_work():
                self._cond.wait(timeout=1.0)
            if self._stop:
                return False
            controls, self._controls = self._controls, deque()
            aborts, self._aborts = self._aborts, []
            self.waiting.extend(self._incoming)
            self._incoming = []
        try:
            for rid, abort_all, message in aborts:
                self._abort_matching(rid, abort_all, message)
            idle_wait = self._run_controls(controls)
            if not self.paused and not idle_wait:
                self._admit()
            if not self.paused and self.running:
                self._decode_step()
        except Exception as exc:  # never let the scheduler die: fail what is running, keep serving
            log.exception("engine step failed; failing the running requests")
            self._fail_running(f"internal engine error: {exc}")
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        return True

    def _fail_running(self, message: str) -> None:
        failed, self.running = self.running, []
        self.batch = self.runner.new_batch()
        for seq in failed:
            seq.row = None
            self._finish(
                seq, {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalError"}
            )

    def _has_work(self) -> bool:
        if self._controls or self._aborts:
            return True
        if self.paused:
            return False
        return bool(self.running or self.waiting or self._incoming)

    def _run_controls(self, controls: deque[_Control]) -> bool:
        """Runs controls in order; a needs-idle one waits (re-queued) while requests run."""
        for i, ctl in enumerate(controls):
            if ctl.needs_idle and self.running and not self.paused:
                with self._cond:
                    remaining = list(controls)[i:]
                    self._controls.extendleft(reversed(remaining))
                return True
            try:
                ctl.future.set_result(ctl.fn())
            except Exception as exc:  # reported to the caller, the engine keeps serving
                ctl.future.set_exception(exc)
        return False

    def _abort_matching(
        self, rid: str, abort_all: bool, message: str, kind: str = "abort", status: int | None = None
    ) -> None:
        def hit(seq: EngineRequest) -> bool:
            return abort_all or seq.rid.startswith(rid)

        for seq in [s for s in self.waiting if hit(s)]:
            self.waiting.remove(seq)
            self._finish(seq, {"type": kind, "message": message, "status_code": status, "err_type": None})
        for seq in sorted((s for s in self.running if hit(s)), key=lambda s: -(s.row or 0)):
            self._finish(seq, {"type": kind, "message": message, "status_code": status, "err_type": None})

    # -- admission / prefill ------------------------------------------------------------------
    def _admit(self) -> None:
        budget = self.prefill_token_budget
        while self.waiting and len(self.running) < self.max_running_requests and budget > 0:
            if not self._adapter_fits(self.waiting[0]):
                break  # in order: it waits until a running request of another adapter finishes
            seq = self.waiting.popleft()
            budget -= len(seq.spec.input_ids)
            try:
                self._prefill(seq)
            except Exception as exc:  # this request fails alone; the batch keeps running
                log.exception("prefill failed for %s", seq.rid)
                if seq.finish_reason is None and seq.row is None:
                    self._finish(
                        seq,
                        {
                            "type": "abort",
                            "message": f"internal engine error: {exc}",
                            "status_code": 500,
                            "err_type": "InternalError",
                        },
                    )

    def _adapter_fits(self, seq: EngineRequest) -> bool:
        """A batch holds at most `max_loras_per_batch` distinct adapters (SGLang's limit)."""
        if seq.adapter is None or self.lora is None:
            return True
        present = {s.adapter for s in self.running if s.adapter is not None}
        return seq.adapter in present or len(present) < self.lora.max_loras_per_batch

    def _prefill(self, seq: EngineRequest) -> None:
        spec = seq.spec
        ids = spec.input_ids
        want_input = spec.return_logprob and spec.logprob_start_len >= 0
        start = min(spec.logprob_start_len, len(ids) - 1) if want_input else len(ids) - 1
        key = self._cache_key(seq)
        matched, past = self.prefix_cache.match(ids, limit=min(len(ids) - 1, start), key=key)
        seq.cached_tokens = matched
        self.metrics.record_prefix(query=len(ids), hit=matched)
        with self._adapters([seq]):
            kv, logits = self.runner.prefill(ids[matched:], past, logits_from=start)
        self.metrics.prompt_tokens.inc(len(ids))
        if want_input:
            self._record_input_logprobs(seq, logits[:-1] if len(logits) > 1 else logits[:0], start)
        if spec.params.max_new_tokens == 0:
            self.prefix_cache.insert(ids, kv, key)
            self._keep_routing(seq, kv)
            self._finish(seq, {"type": "length", "length": 0})
            return
        result = sample(logits[-1:].clone(), [self._row_state(seq)])
        self._append(seq, result, 0)
        reason = self._check_stop(seq)
        if reason is None:
            seq.row = self.batch.add(kv)
            self.running.append(seq)
            self._progress(seq)
        else:
            self.prefix_cache.insert(ids, kv, key)
            self._keep_routing(seq, kv)
            self._finish(seq, reason)

    @staticmethod
    def _keep_routing(seq: EngineRequest, kv: SeqKV) -> None:
        """The routing of every token forwarded for `seq` (cached prefix included), if it asked."""
        if seq.spec.return_routed_experts:
            seq.routing = kv.routing

    def _record_input_logprobs(self, seq: EngineRequest, logits: torch.Tensor, start: int) -> None:
        ids = seq.spec.input_ids
        if seq.spec.logprob_start_len >= len(ids):
            return  # start == prompt length: nothing to report
        lp = log_softmax(logits)
        targets = torch.tensor(ids[start + 1 :], dtype=torch.long)
        vals = lp[torch.arange(len(targets)), targets].tolist() if len(targets) else []
        seq.input_logprobs = [None, *vals]
        if seq.spec.top_logprobs_num:
            k = min(seq.spec.top_logprobs_num, lp.shape[-1])
            top = torch.topk(lp, k, dim=-1) if len(targets) else None
            seq.input_top = [None] + (
                [
                    list(zip(v, i, strict=True))
                    for v, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
                ]
                if top is not None
                else []
            )
        if seq.spec.token_ids_logprob:
            wanted = seq.spec.token_ids_logprob
            seq.input_ids_lp = [None] + [
                list(zip(row, wanted, strict=True)) for row in lp[:, wanted].tolist()
            ]

    # -- decode -------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        tokens = [seq.output_ids[-1] for seq in self.running]
        t0 = time.perf_counter()
        with self._adapters(self.running):
            logits = self.runner.decode(self.batch, tokens)
        result = sample(logits, [self._row_state(s) for s in self.running])
        self.metrics.observe_decode(len(self.running), time.perf_counter() - t0)
        done = []
        for i, seq in enumerate(self.running):
            self._append(seq, result, i)
            reason = self._check_stop(seq)
            if reason is not None:
                done.append((seq, reason))
            else:
                self._progress(seq)
        for seq, reason in sorted(done, key=lambda d: -(d[0].row or 0)):
            self._finish(seq, reason)

    def _row_state(self, seq: EngineRequest) -> RowState:
        blocked = [] if seq.spec.params.ignore_eos else self.eos_token_ids
        return RowState(
            seq.spec.params,
            seq.generator,
            seq.output_ids,
            seq.spec.input_ids,
            blocked + seq.spec.params.stop_token_ids,
            seq.constraint,
        )

    def _append(self, seq: EngineRequest, result, i: int) -> None:
        token = result.tokens[i]
        seq.output_ids.append(token)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        seq.output_logprobs.append(result.logprobs[i])
        spec = seq.spec
        if spec.return_logprob and spec.top_logprobs_num:
            top = torch.topk(
                result.logprob_rows[i], min(spec.top_logprobs_num, result.logprob_rows.shape[-1])
            )
            seq.output_top.append(list(zip(top.values.tolist(), top.indices.tolist(), strict=True)))
        if spec.return_logprob and spec.token_ids_logprob:
            vals = result.logprob_rows[i, spec.token_ids_logprob].tolist()
            seq.output_ids_lp.append(list(zip(vals, spec.token_ids_logprob, strict=True)))
        n = len(seq.output_ids)
        if seq.version_spans and seq.version_spans[-1][0] == self.weight_version:
            seq.version_spans[-1][2] = n
        else:
            seq.version_spans.append([self.weight_version, n - 1, n])
        self.metrics.generation_tokens.inc()

    def _progress(self, seq: EngineRequest) -> None:
        """Tells a streaming client about new tokens (every `stream_interval` tokens; the final chunk comes from `_finish`)."""
        n = len(seq.output_ids)
        if n % (seq.spec.params.stream_interval or 1) == 0:
            seq.notify(seq, n, False)

    def _check_stop(self, seq: EngineRequest) -> dict[str, Any] | None:
        p = seq.spec.params
        token = seq.output_ids[-1]
        n = len(seq.output_ids)
        if n > p.min_new_tokens:
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                return {"type": "stop", "matched": token}
            if p.stop or p.stop_regex:
                text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    pos = text.find(s)
                    if pos >= 0:
                        seq.trimmed_text = text if p.no_stop_trim else text[:pos]
                        return {"type": "stop", "matched": s}
                for pattern in p.stop_regex:
                    m = re.search(pattern, text)
                    if m:
                        seq.trimmed_text = text if p.no_stop_trim else text[: m.start()]
                        return {"type": "stop", "matched": m.group(0)}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(seq.spec.input_ids) + n >= self.runner.context_length:
            return {"type": "length", "length": n}
        return None

    def _finish(self, seq: EngineRequest, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        seq.finished_at = time.monotonic()
        if seq.row is not None:
            kv: SeqKV = self.batch.extract(seq.row)
            self.prefix_cache.insert(seq.spec.input_ids + seq.output_ids, kv, self._cache_key(seq))
            self._keep_routing(seq, kv)
            moved = self.batch.remove(seq.row)
            last = self.running.pop()
            if moved is not None:
                assert last.row == moved
                self.running[seq.row] = last
                last.row = seq.row
            seq.row = None
        self.metrics.requests.labels(finish=reason["type"]).inc()
        self.metrics.latency.observe(seq.finished_at - seq.created)
        seq.notify(seq, len(seq.output_ids), True)
