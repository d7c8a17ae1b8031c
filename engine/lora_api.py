"""SGLang's LoRA endpoints on the embedded engine: ``/load_lora_adapter``, ``/unload_lora_adapter``.

Bodies and answers are SGLang's (docs/engine-protocol.md, "LoRA adapters"): load takes
``{"lora_name", "lora_path", "pinned"}``, unload ``{"lora_name"}``; both answer
``{"success", "error_message", "loaded_adapters": {name: path}}``, 200 on success and 400 with
``success: false`` otherwise — also on a server started without ``--enable-lora``, with SGLang's
own message. As in SGLang a name is loaded once (a new version of an adapter is an unload, then a
load), one load or unload runs at a time, and an unload returns once no request in flight holds
the adapter (requests paused in place hold it: unload after they finish, or pause with abort).
Reading the files happens off the scheduler thread; the adapter joins the model between two
scheduler steps. Files already resident under another name and unchanged since are not read again
(`LoraManager.resident`): the trainer loads each new version under a name of its own before it
pauses, and the load of the served name inside the pause only shares those factors.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from palaestra.engine.lora import NOT_ENABLED
from palaestra.engine.protocol import RequestError
from palaestra.weights_format import FormatError, files_stamp, read_adapter

if TYPE_CHECKING:
    from palaestra.engine.server import EngineServer

__all__ = ["register"]


def _answer(server: EngineServer, error: str | None = None) -> JSONResponse:
    lora = server.engine.lora
    body = {
        "success": error is None,
        "error_message": error,
        "loaded_adapters": lora.loaded() if lora is not None else {},
    }
    return JSONResponse(body, status_code=200 if error is None else 400)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise RequestError("lora_name (a non-empty string) is required")
    return name


async def load(server: EngineServer, name: str, path: str, pinned: bool = False) -> None:
    """Reads the adapter at `path` and adds it as `name` (between two scheduler steps)."""
    lora = server.engine.lora
    if lora is None:
        raise RequestError(NOT_ENABLED)
    stamp = files_stamp(path)  # taken before reading: files replaced meanwhile get read next time
    same = lora.resident(path, stamp)
    if same is not None:  # these files are resident under another name: share its factors
        files, weights = same.files, same.weights
    else:
        try:
            files = await asyncio.to_thread(read_adapter, path)
        except FormatError as exc:  # the request named a bad adapter: the client's error
            raise RequestError(str(exc)) from None
        weights = await asyncio.to_thread(lora.prepare, files)
    await asyncio.wrap_future(
        server.engine.call(lambda: lora.add(name, files, pinned, weights=weights, stamp=stamp))
    )


def register(app: FastAPI, server: EngineServer) -> None:
    """Adds the LoRA routes to the engine's app."""
    lock = asyncio.Lock()  # one load or unload at a time, as SGLang's lora_update_lock

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        try:
            body = await _body(request)
            name, path = _name(body), body.get("lora_path")
            if not isinstance(path, str) or not path:
                raise RequestError("lora_path (the adapter's directory) is required")
            async with lock:
                await load(server, name, path, bool(body.get("pinned", False)))
        except RequestError as exc:
            return _answer(server, str(exc))
        return _answer(server)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        engine = server.engine
        try:
            body = await _body(request)
            name = _name(body)
            if engine.lora is None:
                raise RequestError(NOT_ENABLED)

            def remove():  # and its cached KV, at once when no request holds it (a sync's pause)
                adapter = engine.lora.remove(name)
                held = engine.requests_using(adapter) > 0
                if not held:
                    engine.prefix_cache.drop(adapter.uid)
                return adapter, held

            async with lock:
                adapter, held = await asyncio.wrap_future(engine.call(remove))
                if held:
                    while engine.requests_using(adapter):  # SGLang waits for the requests that hold it
                        await asyncio.sleep(0.01)
                    await asyncio.wrap_future(engine.call(lambda: engine.prefix_cache.drop(adapter.uid)))
        except RequestError as exc:
            return _answer(server, str(exc))
        return _answer(server)
