"""Fixtures the gateway tests share: a scripted engine (a labelled TEST DOUBLE) behind the real
gateway (`stack`: the gateway, the engine and the `TextScript` it answers from), and the real
embedded engine behind a recording proxy (`proxy`: what the gateway sent it and what it answered)."""

from __future__ import annotations

import pytest

from tests.support.servers import RecordingProxy, ScriptedEngine, TextScript, ThreadServer, gateway_server


@pytest.fixture
def stack(tok, tmp_path):
    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end, tok.convert_tokens_to_ids("<|endoftext|>")})
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path / "spool", tok) as gw:
            yield gw, engine, script


@pytest.fixture(scope="module")
def proxy(engine):
    """The module's real engine (tests/conftest.py) behind a `RecordingProxy`: (recorder, server)."""
    rec = RecordingProxy(engine.url)
    with ThreadServer(rec.app()) as srv:
        yield rec, srv
