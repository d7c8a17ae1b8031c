"""The session API from a test's side: open a session, read its trajectory, post its reward, read
the spooled samples (with the test environment key), run an environment's episodes through a
gateway (`rollouts`), the calculator tool the dialect tests use, and a scripted session without a
gateway (`scripted_session`)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.support.servers import ENV_KEY

AUTH = {"Authorization": f"Bearer {ENV_KEY}"}

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


TIMEOUT = 60.0
"""Seconds the helpers below wait for the gateway: httpx's default 5 s ran out on a loaded machine."""


def new_session(gw, **kw):
    r = httpx.post(
        f"{gw.url}/sessions",
        json={"env": "test", "task_id": "t", **kw},
        headers=AUTH,
        timeout=TIMEOUT,
    )
    r.raise_for_status()
    return r.json()


def trajectory(gw, sid):
    return httpx.get(f"{gw.url}/sessions/{sid}", headers=AUTH, timeout=TIMEOUT).json()


def reward(gw, sid, value=1.0, **kw):
    r = httpx.post(
        f"{gw.url}/sessions/{sid}/reward",
        json={"reward": value, **kw},
        headers=AUTH,
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    return r.json()


def samples(gw, after=0):
    return httpx.get(f"{gw.url}/samples", params={"after": after}, headers=AUTH, timeout=TIMEOUT).json()


def rollouts(gateway_url: str, key: str, env: Any, tasks: list, **options: Any) -> Any:
    """`run_rollouts(env, ...)` of `tasks` through the gateway at `gateway_url` with environment key
    `key` (no progress bar), the client closed afterwards: the `RolloutSummary`."""
    from palaestra.sdk import GatewayClient, run_rollouts

    async def run():
        client = GatewayClient(gateway_url, key)
        try:
            return await run_rollouts(env, client, tasks, progress=False, **options)
        finally:
            await client.close()

    return asyncio.run(run())


def tool_reply(name: str, arguments: dict) -> Any:
    """A chat completion whose message calls tool `name` with `arguments` (for `scripted_session`)."""
    import json

    from openai.types.chat import ChatCompletion

    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "policy",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}],
        }
    )


def scripted_session(replies: list) -> Any:
    """A SCRIPTED session without a gateway: its client answers each call with the next of
    `replies` (popped, so a test sees how many were asked for)."""
    import types

    async def create(**kwargs):
        return replies.pop(0)

    completions = types.SimpleNamespace(create=create)
    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=completions))
    return types.SimpleNamespace(
        client=client, sampling={}, session_id="s1", api_key="k", base_url="http://127.0.0.1:9/s/s1/v1"
    )
