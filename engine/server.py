"""The embedded engine's HTTP server: SGLang's native API over `engine.core.Engine`.

Routes, field names and answer shapes follow SGLang (docs/engine-protocol.md); docs/engine.md
lists what is implemented and what is not. Run it with `palaestra engine serve --model tiny`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from palaestra.engine import lora_api, native_model
from palaestra.engine.core import Engine, EngineRequest
from palaestra.engine.lora import LoraManager, parse_lora_paths
from palaestra.engine.protocol import MODEL_DEFAULT_KEYS, RequestError, error_body, parse_generate
from palaestra.engine.weight_group import UpdateGroups
from palaestra.weights_format import FormatError, deserialize_named_tensors, read_adapter

log = logging.getLogger("palaestra.engine")
VERSION = "palaestra-embedded-0.1.0"


@dataclass
class EngineConfig:
    """Options of `palaestra engine serve` (also echoed by /server_info)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    weight_version: str = "default"
    max_running_requests: int = 64
    prefill_token_budget: int = 4096
    prefix_cache_mb: int = 1024
    incremental_streaming_output: bool = False
    num_threads: int | None = None
    disconnect_poll_s: float = 0.5
    enable_lora: bool = False  # LoRA adapters (engine/lora.py, engine/lora_api.py): SGLang's flags
    lora_paths: list[str] = field(default_factory=list)
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    enable_return_routed_experts: bool = False  # MoE models: answer return_routed_experts requests
    model_impl: str = "auto"  # engine/native_model.py: auto, native or transformers


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


async def _json_body(request: Request) -> dict[str, Any]:
    """A control endpoint's body: an object, or {} when empty (RequestError otherwise)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def load_model(model_path: str, model_impl: str = "auto"):
    """Loads a HF-format causal LM + tokenizer on CPU in float32; returns (model, tok, eos ids, defaults).

    `model_impl`: "native" builds the engine's own modules (engine/native_model.py: no
    transformers modeling import, ~1.7 s less CPU per start), "transformers" transformers' model
    class, "auto" the native modules where they serve the model and transformers' otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    if model_impl not in native_model.MODEL_IMPLS:
        raise ValueError(
            f"model_impl must be one of {', '.join(native_model.MODEL_IMPLS)}, not {model_impl!r}"
        )
    model = cfg = None
    if model_impl != "transformers":
        cfg = AutoConfig.from_pretrained(model_path)
        try:
            model = native_model.load(model_path, cfg)
        except native_model.Unsupported as exc:
            if model_impl == "native":
                raise ValueError(f"--model-impl native cannot serve {model_path}: {exc}") from None
            log.info("transformers' modules serve %s (not native: %s)", model_path, exc)
    if model is None:
        from transformers import AutoModelForCausalLM

        kwargs = {} if cfg is None else {"config": cfg}  # the config read above, not read again
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    gen_file = Path(model_path) / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    # the end-of-sequence ids: the config's, generation_config.json's (what transformers'
    # `generation_config` holds; without the file it is the config's) and the tokenizer's
    eos: set[int] = set()
    for source in (model.config.eos_token_id, generation.get("eos_token_id"), tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(x) for x in source)
    # only keys the model explicitly sets (SGLang's --sampling-defaults model)
    defaults = {k: generation[k] for k in MODEL_DEFAULT_KEYS if generation.get(k) is not None}
    return model, tokenizer, sorted(eos), defaults


class EngineServer:
    """Builds the FastAPI app around one Engine."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model, self.tokenizer, eos, self.defaults = load_model(config.model_path, config.model_impl)
        self.model_config = model.config
        self.model_impl_used = "native" if isinstance(model, native_model.CausalLM) else "transformers"
        self.engine = Engine(
            model,
            self.tokenizer,
            eos_token_ids=eos,
            max_running_requests=config.max_running_requests,
            prefill_token_budget=config.prefill_token_budget,
            prefix_cache_bytes=config.prefix_cache_mb << 20,
            weight_version=config.weight_version,
            lora=LoraManager(
                model,
                max_loras_per_batch=config.max_loras_per_batch,
                max_loaded_loras=config.max_loaded_loras,
                max_lora_rank=config.max_lora_rank,
                target_modules=config.lora_target_modules,
            )
            if config.enable_lora or config.lora_paths
            else None,
        )
        for name, path in parse_lora_paths(config.lora_paths):  # --lora-paths: resident from the start
            files = read_adapter(path)
            self.engine.call(lambda n=name, f=files: self.engine.lora.add(n, f, pinned=True)).result()
        self.engine.metrics.set_weight_version(config.weight_version)
        self.update_groups = UpdateGroups()  # /init_weights_update_group and friends
        self.served_name = config.served_model_name or config.model_path
        self.routed_experts_unavailable = self._routed_experts_unavailable()
        self.started = time.time()
        self.app = self._build_app()

    def _routed_experts_unavailable(self) -> str | None:
        """Why a request may not ask for its routed experts (None: it may)."""
        if self.engine.runner.routing is None:
            arch = (getattr(self.model_config, "architectures", None) or ["?"])[0]
            return (
                f"this model ({arch}) is not a mixture-of-experts model: it has no routed experts to "
                f"return (--enable-return-routed-experts serves them for MoE models)"
            )
        if not self.config.enable_return_routed_experts:
            return "this server was not started with --enable-return-routed-experts"
        return None

    # -- answers --------------------------------------------------------------------------------
    def _tok_text(self, tid: int, want: bool) -> str | None:
        return self.tokenizer.decode([tid]) if want else None

    def _triples(self, vals, ids, want_text: bool) -> list[list[Any]]:
        return [[v, t, self._tok_text(t, want_text)] for v, t in zip(vals, ids, strict=True)]

    def _tops(self, rows, want_text: bool):
        return [None if r is None else [[v, t, self._tok_text(t, want_text)] for v, t in r] for r in rows]

    def answer(self, seq: EngineRequest, n: int, final: bool, since: int = 0) -> dict[str, Any]:
        """SGLang's /generate answer for `seq` with its first `n` output tokens (from `since` if incremental)."""
        spec = seq.spec
        out = seq.output_ids[:n]
        p = spec.params
        if final and seq.trimmed_text is not None:
            text = seq.trimmed_text
        else:
            text = self.tokenizer.decode(
                out,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
            )
        if since:
            text = text[len(self.tokenizer.decode(out[:since], skip_special_tokens=p.skip_special_tokens)) :]
        spans = [s for s in seq.version_spans if s[1] < max(n, 1)]
        meta: dict[str, Any] = {
            "id": spec.rid,
            "finish_reason": seq.finish_reason if final else None,
            "prompt_tokens": len(spec.input_ids),
            "completion_tokens": n,
            "cached_tokens": seq.cached_tokens,
            "weight_version": spans[-1][0] if spans else self.engine.weight_version,
        }
        if len(spans) > 1:
            meta["weight_versions"] = [{"version": v, "start": s, "end": min(e, n)} for v, s, e in spans]
        if final:
            meta["e2e_latency"] = (seq.finished_at or time.monotonic()) - seq.created
        if spec.return_logprob:
            want = spec.return_text_in_logprobs
            meta["output_token_logprobs"] = self._triples(seq.output_logprobs[since:n], out[since:], want)
            meta["output_token_logprobs_length"] = n - since
            start = spec.logprob_start_len
            in_ids = spec.input_ids[start:] if start >= 0 else []
            meta["input_token_logprobs"] = self._triples(
                seq.input_logprobs, in_ids[: len(seq.input_logprobs)], want
            )
            if spec.top_logprobs_num:
                meta["output_top_logprobs"] = self._tops(seq.output_top[since:n], want)
                meta["input_top_logprobs"] = self._tops(seq.input_top, want)
            if spec.token_ids_logprob:
                meta["output_token_ids_logprobs"] = self._tops(seq.output_ids_lp[since:n], want)
                meta["input_token_ids_logprobs"] = self._tops(seq.input_ids_lp, want)
        if final and spec.return_routed_experts:
            meta["routed_experts"] = self._routed_experts(seq, n)
        answer: dict[str, Any] = {"text": text, "output_ids": out[since:], "meta_info": meta}
        if spec.return_prompt_token_ids:
            answer["prompt_token_ids"] = spec.input_ids
        return answer

    def _routed_experts(self, seq: EngineRequest, n: int) -> str:
        """SGLang's ``meta_info.routed_experts``: base64 of the int32 array [tokens, layers, top_k]
        of positions ``routed_experts_start_len`` up to the last forwarded one (prompt + n - 1:
        the last sampled token never went through the model)."""
        routing = self.engine.runner.routing
        assert routing is not None  # parse_generate refused the request otherwise
        rows = seq.routing
        if rows is None:  # finished before its prefill (aborted while waiting)
            rows = torch.zeros(0, routing.num_layers, routing.top_k, dtype=torch.int32)
        end = len(seq.spec.input_ids) + n - 1
        rows = rows[seq.spec.routed_experts_start_len : max(end, 0)].contiguous()
        return base64.b64encode(rows.numpy().astype("<i4").tobytes()).decode("ascii")

    # -- /generate ------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        self.engine.metrics.http_requests.inc()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"malformed JSON body: {exc}")
        try:
            req = parse_generate(
                body,
                tokenize=lambda t: self.tokenizer.encode(t, add_special_tokens=False),
                vocab_size=self.engine.runner.vocab_size,
                context_length=self.engine.runner.context_length,
                defaults=self.defaults,
                routed_experts_unavailable=self.routed_experts_unavailable,
            )
        except RequestError as exc:
            return _error(str(exc), exc.status)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def notify(seq: EngineRequest, n: int, finished: bool) -> None:
            if finished or req.stream:
                loop.call_soon_threadsafe(queue.put_nowait, (seq, n, finished))

        try:
            seqs = self.engine.submit(req.specs, notify)
        except RequestError as exc:
            return _error(str(exc), exc.status)
        if req.stream:
            return StreamingResponse(self._stream(req, seqs, queue), media_type="text/event-stream")
        return await self._collect(request, req, seqs, queue)

    async def _collect(
        self, request: Request, req, seqs: list[EngineRequest], queue: asyncio.Queue
    ) -> Response:
        pending = {s.rid for s in seqs}
        while pending:
            try:
                seq, _, finished = await asyncio.wait_for(queue.get(), timeout=self.config.disconnect_poll_s)
            except TimeoutError:
                if await request.is_disconnected():  # SGLang aborts requests whose client went away
                    for rid in pending:
                        self.engine.abort(rid, message="client disconnected")
                    return Response(status_code=499)
                continue
            if finished:
                pending.discard(seq.rid)
        answers = [self.answer(s, len(s.output_ids), True) for s in seqs]
        for s in seqs:
            status = (s.finish_reason or {}).get("status_code")
            if s.finish_reason and s.finish_reason.get("type") == "abort" and status:
                return _error(s.finish_reason.get("message", "aborted"), status)
        return JSONResponse(answers if req.batched else answers[0])

    async def _stream(self, req, seqs: list[EngineRequest], queue: asyncio.Queue):
        pending = {s.rid for s in seqs}
        sent = {s.rid: 0 for s in seqs}
        incremental = self.config.incremental_streaming_output
        try:
            while pending:
                seq, n, finished = await queue.get()
                if seq.rid not in pending or (n <= sent[seq.rid] and not finished):
                    continue
                if finished:
                    n = len(seq.output_ids)
                chunk = self.answer(seq, n, finished, since=sent[seq.rid] if incremental else 0)
                sent[seq.rid] = n
                if req.batched:
                    chunk["index"] = seq.spec.index
                if finished:
                    pending.discard(seq.rid)
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for rid in pending:  # client went away mid-stream
                self.engine.abort(rid, message="client disconnected")

    # -- control --------------------------------------------------------------------------------
    async def _control(self, fn, needs_idle: bool = False):
        return await asyncio.wrap_future(self.engine.call(fn, needs_idle=needs_idle))

    async def _apply_weights(
        self, load: Callable[[], int], body: dict[str, Any], source: str
    ) -> JSONResponse:
        """Runs `load` (returns the tensor count) on the engine thread once idle, then flush/version."""
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            self.engine.abort("", True, message="aborted for a weight update")

        def apply():
            count = load()
            if body.get("flush_cache", True):
                self.engine.prefix_cache.clear()
            if version is not None:
                self.engine.set_weight_version(str(version))
            return count

        try:
            count = await self._control(apply, needs_idle=True)
        except RequestError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return JSONResponse(
            {
                "success": True,
                "num_paused_requests": 0,
                "message": f"Succeeded to update {count} tensors from {source}.",
            }
        )

    def _info(self) -> dict[str, Any]:
        cfg = self.model_config
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": json.dumps(self.defaults) if self.defaults else None,
            "weight_version": self.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }

    def _server_info(self) -> dict[str, Any]:
        ctx = self.engine.runner.context_length
        return {
            **asdict(self.config),
            "model_impl_used": self.model_impl_used,
            "served_model_name": self.served_name,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": ctx,
            "vocab_size": self.engine.runner.vocab_size,
            "max_total_num_tokens": ctx * self.config.max_running_requests,
            "max_running_requests": self.config.max_running_requests,
            "max_req_input_len": ctx - 1,
            "weight_version": self.engine.weight_version,
            "loaded_lora_adapters": self.engine.lora.loaded() if self.engine.lora is not None else {},
            "skip_tokenizer_init": False,
            "internal_states": [
                {
                    "running": len(self.engine.running),
                    "waiting": len(self.engine.waiting),
                    "paused": self.engine.paused,
                    "prefix_cache_entries": len(self.engine.prefix_cache),
                }
            ],
            "version": VERSION,
            "engine": "palaestra-embedded",
        }

    def _build_app(self) -> FastAPI:
        server = self

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            yield
            server.engine.shutdown()

        app = FastAPI(title="palaestra embedded engine (SGLang protocol)", lifespan=lifespan)
        app.add_api_route("/generate", self.generate, methods=["POST", "PUT"])
        lora_api.register(app, self)
        self._add_probes(app)
        self._add_controls(app)
        self._add_weight_updates(app)

        @app.exception_handler(RequestError)
        async def request_error(_: Request, exc: RequestError) -> JSONResponse:
            return _error(str(exc), exc.status)

        return app

    def _add_probes(self, app: FastAPI) -> None:
        """Health, model and server info, the weight version, /v1/models, /metrics."""
        server = self

        @app.get("/health")
        async def health() -> Response:
            # Cheap on purpose: the router drops a worker after 3 failed probes (protocol section 7.5).
            return Response(status_code=200)

        @app.get("/health_generate")
        async def health_generate() -> Response:
            return Response(status_code=200)

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return server._info()

        @app.get("/server_info")
        @app.get("/get_server_info")
        async def server_info() -> dict[str, Any]:
            return server._server_info()

        @app.get("/get_weight_version")
        async def get_weight_version() -> dict[str, Any]:
            return {"weight_version": server.engine.weight_version}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {
                        "id": server.served_name,
                        "object": "model",
                        "created": int(server.started),
                        "owned_by": "sglang",
                        "root": server.served_name,
                        "max_model_len": server.engine.runner.context_length,
                    }
                ],
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(server.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    def _add_controls(self, app: FastAPI) -> None:
        """Abort, pause and continue generation, flush the prefix cache."""
        server = self

        @app.post("/abort_request")
        async def abort_request(request: Request) -> Response:
            body = await _json_body(request)
            server.engine.abort(str(body.get("rid", "") or ""), bool(body.get("abort_all", False)))
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(request: Request) -> dict[str, str]:
            mode = (await _json_body(request)).get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise RequestError(f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
            await server._control(lambda: server.engine.pause(mode))
            if mode == "abort":  # returns once nothing is in flight
                while server.engine.running:
                    await asyncio.sleep(0.005)
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation(request: Request) -> dict[str, str]:
            await _json_body(request)
            await server._control(server.engine.resume)
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache() -> Response:
            if await server._control(server.engine.flush):
                return PlainTextResponse("Cache flushed.\n", status_code=200)
            return PlainTextResponse(
                "Cache not flushed: there are running or waiting requests.\n", status_code=400
            )

    def _add_weight_updates(self, app: FastAPI) -> None:
        """Weights from disk, from tensors, over a torch.distributed group; the weight version."""
        server = self

        @app.post("/update_weights_from_disk")
        async def update_from_disk(request: Request) -> JSONResponse:
            body = await _json_body(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise RequestError("model_path is required")
            load_format = body.get("load_format")
            if load_format not in (None, "auto", "safetensors", "mmap"):
                raise RequestError(
                    "load_format must be null, 'auto', 'safetensors' or 'mmap' (share the file's memory) "
                    "for the embedded engine"
                )
            # read straight into the parameters on the engine thread (one copy), or share the file
            return await server._apply_weights(
                lambda: server.engine.load_weights_from_file(path, share=load_format == "mmap"), body, path
            )

        @app.post("/update_weights_from_tensor")
        async def update_from_tensor(request: Request) -> JSONResponse:
            body = await _json_body(request)
            try:
                named = await asyncio.to_thread(
                    deserialize_named_tensors, body.get("serialized_named_tensors"), body.get("load_format")
                )
            except FormatError as exc:
                return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
            return await server._apply_weights(lambda: server.engine.load_weights(named), body, "tensor")

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(request: Request) -> JSONResponse:
            body = await _json_body(request)
            try:  # blocks until every rank has joined: off the event loop
                message = await asyncio.to_thread(server.update_groups.init, body)
            except RequestError as exc:
                return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
            return JSONResponse({"success": True, "message": message})

        @app.post("/update_weights_from_distributed")
        async def update_from_distributed(request: Request) -> JSONResponse:
            body = await _json_body(request)
            try:
                named = await asyncio.to_thread(server.update_groups.receive, body)
            except RequestError as exc:
                return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
            return await server._apply_weights(lambda: server.engine.load_weights(named), body, "distributed")

        @app.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(request: Request) -> JSONResponse:
            body = await _json_body(request)
            try:
                message = await asyncio.to_thread(server.update_groups.destroy, body)
            except RequestError as exc:
                return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
            return JSONResponse({"success": True, "message": message})

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request) -> dict[str, Any]:
            body = await _json_body(request)
            version = body.get("new_version")
            if not isinstance(version, str) or not version:
                raise RequestError("new_version (a non-empty string) is required")
            if body.get("abort_all_requests", True):
                server.engine.abort("", True, message="aborted for a weight version update")
            await server._control(lambda: server.engine.set_weight_version(version))
            return {"success": True, "message": "Weight version updated.", "new_version": version}
