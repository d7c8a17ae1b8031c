"""A zero-work engine for benchmarks: answers SGLang's /generate at once with fixed token ids.

    python bench/zero_engine.py --port 31000 --reply-ids 1234 2

It does no model work, so what a benchmark measures through it is the overhead of the layers in
front (router, gateway). It serves the probes the router needs (/health, /server_info, /model_info,
/v1/models with owned_by "sglang"). Not a test double of the engine's behaviour: only for overhead.
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


def make_app(reply_ids: list[int], context_length: int) -> FastAPI:
    app = FastAPI()
    lps = [[-0.1, t, None] for t in reply_ids]
    count = {"n": 0}

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        count["n"] += 1
        return JSONResponse(
            {
                "text": "",
                "output_ids": reply_ids,
                "meta_info": {
                    "id": str(count["n"]),
                    "finish_reason": {"type": "stop", "matched": reply_ids[-1]},
                    "prompt_tokens": len(body.get("input_ids") or []),
                    "completion_tokens": len(reply_ids),
                    "cached_tokens": 0,
                    "weight_version": "zero",
                    "output_token_logprobs": lps,
                },
            }
        )

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument(
        "--reply-ids", type=int, nargs="+", required=True, help="token ids of every answer (last = stop)"
    )
    ap.add_argument("--context-length", type=int, default=32768)
    args = ap.parse_args()
    uvicorn.run(
        make_app(args.reply_ids, args.context_length),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
