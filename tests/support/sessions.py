"""The session API from a test's side: open a session, read its trajectory, post its reward, read
the spooled samples (with the test environment key), and the calculator tool the dialect tests use."""

from __future__ import annotations

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


def new_session(gw, **kw):
    r = httpx.post(
        f"{gw.url}/sessions",
        json={"env": "test", "task_id": "t", **kw},
        headers=AUTH,
    )
    r.raise_for_status()
    return r.json()


def trajectory(gw, sid):
    return httpx.get(f"{gw.url}/sessions/{sid}", headers=AUTH).json()


def reward(gw, sid, value=1.0, **kw):
    r = httpx.post(
        f"{gw.url}/sessions/{sid}/reward",
        json={"reward": value, **kw},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    return r.json()


def samples(gw, after=0):
    return httpx.get(f"{gw.url}/samples", params={"after": after}, headers=AUTH).json()
