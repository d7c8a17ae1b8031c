"""A simulated engine: SGLang's /generate answered after a modelled latency, sleeping, never computing.

    python -m palaestra.testing.sim --port 31001                      # one engine
    python -m palaestra.testing.sim --port 31001 31002 31003 31004    # four engines, one process
    python -m palaestra.testing.sim --print-params                    # the parameter table and sources
    python -m palaestra.testing.sim --port 31001 --time-scale 4 --param kv_capacity_tokens=200000

Each engine is its own HTTP server on its own port (the router sees separate workers) with its
own scheduler, prefix cache and KV capacity (`palaestra/testing/sim_model.py`: the model and the parameter
table for Llama-3-8B on one H100, with the source of every figure). An engine waits on asyncio
timers until the modelled end of each prefill or decode iteration, so dozens of them run in one
process on two cores: it is for benchmarks of what stands in front (router, placement), like the
zero-work engine (`palaestra/testing/zero.py`), but its answers take the time an engine would take.

`--time-scale S` stretches every modelled time by S in wall time (answers report modelled times):
use it when the machine cannot keep up with many engines at full speed.

Protocol: `POST /generate` with `input_ids` (one prompt) and `sampling_params.max_new_tokens`
(default 128) answers exactly that many ids, chosen by the prompt and `sampling_params.sampling_seed`
alone; `meta_info` has `prompt_tokens`, `completion_tokens`, `cached_tokens` (prompt tokens found
in its prefix cache), `e2e_latency` (modelled seconds), `output_token_logprobs` with
`return_logprob`, and `sim` (this engine's name, modelled queue/prefill/total seconds). A body is
checked by the real engine's parser (`engine/protocol.py`: the same 400s for bad bodies, a prompt
longer than `kv_capacity_tokens` included); text prompts, batches, `n` > 1, streaming and
`max_new_tokens` 0 are a 400 naming the field. It serves the probes the
router needs (`/health`, `/server_info`, `/model_info`, `/v1/models`), `POST /flush_cache`, and
`GET /sim/stats` (counters, current load, timer lag).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from palaestra.engine.protocol import PromptSpec, RequestError, error_body, parse_generate
from palaestra.testing.sim_model import PARAM_SOURCES, SimParams, SimRequest, SimScheduler

__all__ = ["SimEngine", "make_app", "process", "serve"]


class SimEngine:
    """One simulated engine: a `SimScheduler` driven by asyncio timers in (scaled) wall time."""

    def __init__(self, name: str, params: SimParams, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0 (got {time_scale})")
        self.name = name
        self.params = params
        self.scale = time_scale
        self.scheduler = SimScheduler(params)
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._due: float | None = None
        self._ids = 0
        self.lag_max_s = 0.0  # how late a timer fired, wall seconds (the process falling behind)
        self.lag_sum_s = 0.0
        self.lag_n = 0

    def now(self) -> float:
        """Modelled seconds since this engine started."""
        return (self._loop.time() - self._t0) / self.scale

    async def generate(self, prompt: list[int], max_new_tokens: int, seed: int) -> SimRequest:
        """Queues one request and waits for its modelled completion (ValueError: it cannot fit)."""
        future: asyncio.Future[None] = self._loop.create_future()
        request = SimRequest(prompt, max_new_tokens, self.now(), seed=seed, tag=future)
        self.scheduler.submit(request, request.arrived)
        self._kick()
        await future
        return request

    def flush(self) -> bool:
        """Clears the prefix cache when nothing runs or waits (as SGLang's /flush_cache)."""
        s = self.scheduler
        if s.waiting or s.prefilling or s.running:
            return False
        self.scheduler = SimScheduler(self.params)
        self.scheduler.stats = s.stats
        return True

    def _kick(self, from_timer: bool = False) -> None:
        if from_timer and self._due is not None:
            late = self._loop.time() - self._due
            self.lag_max_s = max(self.lag_max_s, late)
            self.lag_sum_s += late
            self.lag_n += 1
        for request in self.scheduler.advance(self.now()):
            if not request.tag.done():  # the client may have gone away
                request.tag.set_result(None)
        due = self.scheduler.next_event()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if due is not None:
            self._due = self._t0 + due * self.scale
            self._timer = self._loop.call_at(self._due, self._kick, True)

    def stats(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "now_s": self.now(),
            "time_scale": self.scale,
            "stats": dataclasses.asdict(self.scheduler.stats),
            "load": self.scheduler.load(),
            "timer_lag_s": {
                "mean": self.lag_sum_s / self.lag_n if self.lag_n else 0.0,
                "max": self.lag_max_s,
                "n": self.lag_n,
            },
        }


# Llama-3's vocabulary: the real engine's parser checks prompt ids against it.
VOCAB_SIZE = 128_256


def _bad(message: str, status: int = 400) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(error_body(message, status)), content_type="application/json"
    )


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def _no_text(_: str) -> list[int]:
    raise RequestError("the simulated engine takes token ids (input_ids), not text")


def parse(raw: bytes, params: SimParams) -> PromptSpec:
    """One `/generate` body checked by the real engine's parser (`engine/protocol.parse_generate`,
    the same 400s), then refused where it asks for what is not simulated: one prompt, one sample,
    no streaming, at least one new token (RequestError, naming the field)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    request = parse_generate(
        body, tokenize=_no_text, vocab_size=VOCAB_SIZE, context_length=params.kv_capacity_tokens, defaults={}
    )
    if request.stream:
        raise RequestError("stream: the simulated engine does not stream")
    spec = request.specs[0]
    if spec.params.n != 1:
        raise RequestError("sampling_params.n > 1 is not simulated")
    if request.batched:
        raise RequestError("input_ids: one prompt per call (batches are not simulated)")
    if spec.params.max_new_tokens < 1:
        raise RequestError("sampling_params.max_new_tokens must be >= 1 for the simulated engine")
    return spec


def make_app(engine_ref: dict[str, SimEngine], name: str) -> web.Application:
    """The HTTP face of one engine (`engine_ref["engine"]` is created once the loop runs)."""
    app = web.Application(client_max_size=256 * 1024 * 1024)

    async def generate(request: web.Request) -> web.Response:
        engine = engine_ref["engine"]
        try:
            spec = parse(await request.read(), engine.params)
            ids, max_new = spec.input_ids, spec.params.max_new_tokens
            req = await engine.generate(ids, max_new, spec.params.sampling_seed or 0)
        except (RequestError, ValueError) as exc:  # ValueError: the scheduler cannot fit it
            return _bad(str(exc), getattr(exc, "status", 400))
        assert req.finished is not None and req.admitted is not None and req.first_token is not None
        engine._ids += 1
        meta: dict[str, Any] = {
            "id": f"{name}-{engine._ids}",
            "finish_reason": {"type": "length", "length": max_new},
            "prompt_tokens": len(ids),
            "completion_tokens": max_new,
            "cached_tokens": req.cached_tokens,
            "weight_version": "sim",
            "e2e_latency": req.finished - req.arrived,
            "sim": {
                "engine": name,
                "queue_s": req.admitted - req.arrived,
                "first_token_s": req.first_token - req.arrived,
                "modelled_s": req.finished - req.arrived,
                # wall clock (time.monotonic, the same on every process of the machine): how long
                # the call took to reach the engine and to leave it, for the bench's overhead line
                "arrived_monotonic": engine._t0 + req.arrived * engine.scale,
                "answered_monotonic": engine._loop.time(),
                "retractions": req.retractions,
            },
        }
        if spec.return_logprob:
            meta["output_token_logprobs"] = [[-0.1, t, None] for t in req.output]
        return _json({"text": "", "output_ids": req.output, "meta_info": meta})

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(_: web.Request) -> web.Response:
        p = engine_ref["engine"].params
        return _json(
            {
                "context_length": p.kv_capacity_tokens,
                "model_path": "sim",
                "tp_size": 1,
                "dp_size": 1,
                "weight_version": "sim",
                "version": "sim",
                "max_total_num_tokens": p.kv_capacity_tokens,
            }
        )

    async def model_info(_: web.Request) -> web.Response:
        return _json({"model_path": "sim", "is_generation": True, "weight_version": "sim"})

    async def models(_: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{"id": "sim", "object": "model", "owned_by": "sglang"}]})

    async def flush_cache(_: web.Request) -> web.Response:
        if engine_ref["engine"].flush():
            return web.Response(status=200, text="Cache flushed.")
        return web.Response(status=400, text="Cache not flushed: requests are running or waiting.")

    async def stats(_: web.Request) -> web.Response:
        return _json(engine_ref["engine"].stats())

    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_get("/sim/stats", stats)
    return app


async def serve(ports: Sequence[int], params: SimParams, time_scale: float, host: str = "127.0.0.1") -> None:
    """Runs one engine per port in this event loop until cancelled."""
    runners = []
    for port in ports:
        ref = {"engine": SimEngine(f"sim-{port}", params, time_scale)}
        runner = web.AppRunner(make_app(ref, f"sim-{port}"), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=1024).start()
        runners.append(runner)
    print(
        f"sim: {len(ports)} engine(s) on {host} ports {' '.join(map(str, ports))} time_scale={time_scale}",
        file=sys.stderr,
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def process(count: int, *, time_scale: float = 1.0, params: dict[str, float] | None = None) -> Any:
    """`count` engines in one subprocess on free 127.0.0.1 ports (`palaestra.net.ServerProcess`,
    a context manager that waits until they answer); `.urls` lists them."""
    from palaestra.net import ServerProcess, free_port

    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    argv = [
        sys.executable,
        "-m",
        "palaestra.testing.sim",
        "--port",
        *map(str, ports),
        "--time-scale",
        str(time_scale),
    ]
    for key, value in (params or {}).items():
        argv += ["--param", f"{key}={value}"]
    proc = ServerProcess(argv, f"http://127.0.0.1:{ports[-1]}", name="sim-engines", startup_timeout=60)
    proc.urls = [f"http://127.0.0.1:{p}" for p in ports]  # type: ignore[attr-defined]
    return proc


def _parse_overrides(items: Sequence[str]) -> dict[str, float]:
    fields = {f.name: f.type for f in dataclasses.fields(SimParams)}
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--param {item!r}: expected NAME=VALUE with NAME one of {sorted(fields)}")
        out[key] = int(value) if fields[key] == "int" else float(value)
    return out


def params_table(params: SimParams) -> str:
    """The parameter table: name, value, source (what --print-params shows)."""
    rows = [
        f"{f.name} = {getattr(params, f.name)!r}\n    {PARAM_SOURCES[f.name]}"
        for f in dataclasses.fields(params)
    ]
    return "Llama-3-8B (bf16) on one H100, as SGLang serves it:\n" + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, nargs="+", help="one engine per port")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per modelled second (default: %(default)s)",
    )
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a parameter of the table (see --print-params), e.g. kv_capacity_tokens=200000",
    )
    ap.add_argument(
        "--print-params", action="store_true", help="print the parameter table with sources and exit"
    )
    args = ap.parse_args(argv)
    try:
        params = SimParams().with_overrides(**_parse_overrides(args.param))
    except ValueError as exc:
        ap.error(str(exc))
    if args.print_params:
        print(params_table(params))
        return 0
    if not args.port:
        ap.error("give --port (one or more) or --print-params")
    if args.time_scale <= 0:
        ap.error("--time-scale must be > 0")
    try:
        asyncio.run(serve(args.port, params, args.time_scale, args.host))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
