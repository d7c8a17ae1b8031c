"""A zero-work engine: answers SGLang's /generate at once, with no model behind it.

    python -m palaestra.testing.zero --port 31000 --reply-ids 1234 2            # every answer the same
    python -m palaestra.testing.zero --port 31000 --alphabet 67 68 69 --stop-id 2 --reply-len 8

It does no model work, so what a benchmark or a load test measures through it is the layers in front
(router, gateway). Two kinds of answer:

* `--reply-ids`: the same ids every time (bench/gateway.py: per-call overhead);
* `--alphabet`: `derived_reply(routing key, prompt length)`, ids drawn from the alphabet by a hash of
  the request's `X-SMG-Routing-Key` and its number of input ids, then the stop id. Every session
  (the gateway sends its id as the routing key) and every turn of it (the prompt grows) gets its own
  answer, and whoever knows the session id and the prompt length knows the answer: a load test can
  check that each session recorded exactly what the engine produced for it, with no cross-talk.

An answer longer than the request's `sampling_params.max_new_tokens` is cut there and reported as
`length`, as an engine's would be (bench/gateway.py's paired test asks for answers cut at the limit).

The input ids are counted, not parsed (`read_body`): turning 100k ids of JSON into Python ints cost
this engine 5-7 ms a call (the stdlib's parser, FastAPI's `request.json()`), more for larger ids, and
freeing them delayed its next answer, so a bench pairing a gateway call with a direct one of as
many ids measured the engine's work on two different id lists and on the call before. With
`--keep-bodies` it keeps each routing key's last /generate body (`GET /last_body?key=K`), so a bench
can send the engine exactly what the gateway sent.

It serves the probes the router and the gateway need (/health, /server_info, /model_info,
/v1/models with owned_by "sglang"), and `POST /sink`, which reads a body and drops it (a bench times
what carrying a client's body costs alone). It is not a model of the engine's behaviour (no sampling, no
streaming, no pause or weight sync): only for measuring and loading what stands in front of it.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

ROUTING_HEADER = "x-smg-routing-key"


def process(*flags: str) -> Any:
    """This engine as a subprocess on a free 127.0.0.1 port (`palaestra.net.ServerProcess`, a
    context manager that waits for /health), with `flags` (``--reply-ids ...`` or ``--alphabet ...``)."""
    import sys

    from palaestra.net import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "palaestra.testing.zero", "--port", str(port), *flags]
    return ServerProcess(argv, f"http://127.0.0.1:{port}", name="zero-engine", free_ports=["--port"])


def derived_reply(key: str, prompt_len: int, alphabet: list[int], length: int, stop_id: int) -> list[int]:
    """The answer of the alphabet mode: `length` ids chosen by sha256(key:prompt_len), then `stop_id`."""
    digest = hashlib.sha256(f"{key}:{prompt_len}".encode()).digest()
    while len(digest) < length:  # replies longer than one digest: extend the hash chain
        digest += hashlib.sha256(digest).digest()
    return [alphabet[b % len(alphabet)] for b in digest[:length]] + [stop_id]


_IDS = re.compile(rb'"input_ids"\s*:\s*\[([0-9,\s]*)\]')


def read_body(raw: bytes) -> tuple[int, dict[str, Any]]:
    """(the number of input ids, the rest of the body) of a /generate body, the ids counted in the
    raw bytes (module doc); any body the count cannot be sure of is parsed whole."""
    m = _IDS.search(raw) if raw.count(b'"input_ids"') == 1 else None  # a key, in one place only
    if m is not None:
        try:
            rest = orjson.loads(raw[: m.start(1)] + raw[m.end(1) :])
        except orjson.JSONDecodeError:
            rest = None
        if isinstance(rest, dict) and rest.get("input_ids") == []:  # the match was the top-level list
            ids = m.group(1)
            return (ids.count(b",") + 1 if ids.strip() else 0), rest
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("the body is not a JSON object")
    return len(body.get("input_ids") or []), body


def make_app(
    reply_ids: list[int] | None = None,
    *,
    alphabet: list[int] | None = None,
    stop_id: int | None = None,
    reply_len: int = 8,
    context_length: int = 32768,
    keep_bodies: bool = False,
) -> FastAPI:
    """The engine app: fixed `reply_ids`, or `derived_reply` over `alphabet` + `stop_id`; with
    `keep_bodies`, each routing key's last /generate body served at `GET /last_body?key=`."""
    if (reply_ids is None) == (alphabet is None):
        raise ValueError("give exactly one of reply_ids and alphabet")
    if alphabet is not None and (not alphabet or stop_id is None or reply_len < 1):
        raise ValueError("the alphabet mode needs a non-empty alphabet, a stop_id and reply_len >= 1")
    app = FastAPI()
    count = {"n": 0}  # answer ids, for meta_info.id (one event loop: no lock needed)
    last_bodies: dict[str, bytes] = {}

    def answer_ids(request: Request, prompt_len: int) -> list[int]:
        if reply_ids is not None:
            return reply_ids
        assert alphabet is not None and stop_id is not None
        return derived_reply(
            request.headers.get(ROUTING_HEADER, ""), prompt_len, alphabet, reply_len, stop_id
        )

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        raw = await request.body()
        prompt_len, body = read_body(raw)
        if keep_bodies:
            last_bodies[request.headers.get(ROUTING_HEADER, "")] = raw
        ids = answer_ids(request, prompt_len)
        limit = (body.get("sampling_params") or {}).get("max_new_tokens")
        finish: dict[str, Any] = {"type": "stop", "matched": ids[-1]}
        if isinstance(limit, int) and 0 < limit < len(ids):
            ids, finish = ids[:limit], {"type": "length", "length": limit}
        count["n"] += 1
        meta: dict[str, Any] = {
            "id": str(count["n"]),
            "finish_reason": finish,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": "zero",
            "output_token_logprobs": [[-0.1, t, None] for t in ids],
        }
        return JSONResponse({"text": "", "output_ids": ids, "meta_info": meta})

    @app.get("/last_body")
    async def last_body(key: str = "") -> Response:
        if key not in last_bodies:
            return Response(status_code=404)
        return Response(last_bodies[key], media_type="application/json")

    @app.post("/sink")
    async def sink(request: Request) -> Response:
        """Reads a body and drops it: what carrying a body to a Python server costs, alone."""
        await request.body()
        return Response(b"{}", media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {
            "context_length": context_length,
            "model_path": "zero",
            "tp_size": 1,
            "dp_size": 1,
            "weight_version": "zero",
            "version": "zero",
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": "zero", "is_generation": True, "weight_version": "zero"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "zero", "object": "model", "owned_by": "sglang"}]}

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--reply-ids", type=int, nargs="+", help="token ids of every answer (last = stop)")
    mode.add_argument("--alphabet", type=int, nargs="+", help="token ids derived answers are drawn from")
    ap.add_argument("--stop-id", type=int, help="alphabet mode: the id that ends every answer")
    ap.add_argument("--reply-len", type=int, default=8, help="alphabet mode: ids per answer before the stop")
    ap.add_argument("--context-length", type=int, default=32768)
    ap.add_argument(
        "--keep-bodies", action="store_true", help="keep each routing key's last body: GET /last_body?key=K"
    )
    args = ap.parse_args(argv)
    if args.alphabet is not None and args.stop_id is None:
        ap.error("--alphabet needs --stop-id")
    app = make_app(
        args.reply_ids,
        alphabet=args.alphabet,
        stop_id=args.stop_id,
        reply_len=args.reply_len,
        context_length=args.context_length,
        keep_bodies=args.keep_bodies,
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
