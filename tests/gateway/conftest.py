"""Fixtures the gateway tests share: a scripted engine (a labelled TEST DOUBLE) behind the real
gateway (`stack`: the gateway, the engine and the `TextScript` it answers from)."""

from __future__ import annotations

import pytest

from tests.support.servers import ScriptedEngine, TextScript, ThreadServer, gateway_server


@pytest.fixture
def stack(tok, tmp_path):
    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end, tok.convert_tokens_to_ids("<|endoftext|>")})
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path / "spool", tok) as gw:
            yield gw, engine, script
