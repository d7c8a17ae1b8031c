"""The dialects' shared field checks (`gateway/dialects/validate.py`) and the error envelope each route
answers in (`Dialect.error_body`, read by the app's error handlers and the body limit).

Out-of-range numbers carry OpenAI's codes in both OpenAI dialects (chat completions and the
Responses API), as OpenAI's API answers them: before one validator, only chat's `n` had a code
(`integer_above_max_value`) and the Responses API gave none. Anthropic's envelope has no code, and
its messages start with the field ("temperature: must be ..."). Checked with the real `openai` and
`anthropic` SDKs against the real gateway; the engine is a SCRIPTED ENGINE (a labelled TEST DOUBLE
from tests/support/servers.py) that answers /generate with fixed token ids."""

from __future__ import annotations

import math

import anthropic
import httpx
import openai
import pytest

from palaestra.gateway.dialects.validate import MAX_STOPS, number, stop_list
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.routes import error_body
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server

KEY = {"Authorization": "Bearer k-test"}


def refusal(body: dict, key: str, lo: float, hi: float, integer: bool = False) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        number(body, key, lo, hi, integer=integer)
    assert caught.value.status == 400 and caught.value.param == key
    return caught.value


def test_numbers_are_checked_with_openais_codes():
    assert number({}, "n", 1, 64, integer=True) is None and number({"n": None}, "n", 1, 64) is None
    assert number({"n": 2.0}, "n", 1, 64, integer=True) == 2 and number({"t": 1}, "t", 0, 2) == 1.0
    for body, integer, code, words in (
        ({"x": 65}, True, "integer_above_max_value", "'x' must be between 1 and 64; got 65"),
        ({"x": 0}, True, "integer_below_min_value", "'x' must be between 1 and 64; got 0"),
        ({"x": 64.5}, False, "decimal_above_max_value", "between 1 and 64; got 64.5"),
        ({"x": 0.5}, False, "decimal_below_min_value", "between 1 and 64; got 0.5"),
        ({"x": "3"}, False, "invalid_type", "'x' must be a number"),
        ({"x": True}, True, "invalid_type", "'x' must be an integer"),  # a boolean is no number
        ({"x": 2.5}, True, "invalid_type", "'x' must be an integer"),
        ({"x": math.inf}, True, "invalid_type", "'x' must be an integer"),  # never an OverflowError
        ({"x": math.nan}, True, "invalid_type", "'x' must be an integer"),
    ):
        exc = refusal(body, "x", 1, 64, integer)
        assert exc.code == code and words in exc.message, (body, exc.code, exc.message)
    assert refusal({"x": math.nan}, "x", 0, 1).code == "decimal_below_min_value"  # out of every range
    exc = refusal({"max_tokens": 0}, "max_tokens", 1, math.inf, integer=True)
    assert exc.message == "'max_tokens' must be at least 1; got 0"  # never "between 1 and inf"


def test_stop_lists():
    assert stop_list({}, "stop") == [] and stop_list({"stop": ["a", "b"]}, "stop") == ["a", "b"]
    assert stop_list({"stop": "a"}, "stop", one_string=True) == ["a"]
    assert stop_list({"stop": ["", "a"]}, "stop", one_string=True) == ["a"]  # OpenAI: empties dropped
    assert stop_list({"stop": ""}, "stop", one_string=True) == []
    for body, one_string in (
        ({"stop": "a"}, False),  # Responses and Anthropic take arrays only
        ({"stop": [""]}, False),
        ({"stop": ["a"] * (MAX_STOPS + 1)}, True),
        ({"stop": [1]}, True),
        ({"stop": {}}, False),
        ({"stop": ["x" * 257]}, True),
    ):
        with pytest.raises(GatewayError) as caught:
            stop_list(body, "stop", one_string=one_string)
        assert caught.value.param == "stop" and caught.value.message.startswith("'stop' "), body


@pytest.fixture(scope="module")
def gw(tok, tmp_path_factory):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(lambda ids, i: tok.encode("ok", add_special_tokens=False) + [end], stop_ids={end})
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path_factory.mktemp("spool"), tok, max_body_bytes=4096) as server:
            yield server


def session_url(gw) -> str:
    r = httpx.post(f"{gw.url}/sessions", json={"env": "validate", "task_id": "t"}, headers=KEY)
    return r.json()["base_url"]


def test_both_openai_dialects_answer_out_of_range_numbers_with_openais_codes(gw):
    client = openai.OpenAI(base_url=session_url(gw), api_key="k-test", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    for call, code, param in (
        (lambda: client.chat.completions.create(model="tiny", messages=msgs, temperature=3), "decimal_above_max_value", "temperature"),
        (lambda: client.chat.completions.create(model="tiny", messages=msgs, n=65), "integer_above_max_value", "n"),
        (lambda: client.chat.completions.create(model="tiny", messages=msgs, max_tokens=0), "integer_below_min_value", "max_tokens"),
        (lambda: client.responses.create(model="tiny", input="hi", temperature=3), "decimal_above_max_value", "temperature"),
        (lambda: client.responses.create(model="tiny", input="hi", top_logprobs=21), "integer_above_max_value", "top_logprobs"),
        (lambda: client.responses.create(model="tiny", input="hi", max_output_tokens=0), "integer_below_min_value", "max_output_tokens"),
        (lambda: client.completions.create(model="tiny", prompt="hi", top_p=-1), "decimal_below_min_value", "top_p"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.code == code and caught.value.param == param, caught.value.body


def test_anthropic_answers_the_same_checks_in_its_own_envelope(gw):
    client = anthropic.Anthropic(
        base_url=session_url(gw).removesuffix("/v1"), api_key="k-test", max_retries=0
    )
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs, message in (
        ({"temperature": 1.5}, "temperature: must be between 0 and 1; got 1.5"),
        ({"top_k": 0}, "top_k: must be between 1 and 1073741824; got 0"),
        ({"stop_sequences": [""]}, "stop_sequences: must be an array of up to 16 non-empty strings"),
    ):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="tiny", messages=msgs, max_tokens=4, extra_body=kwargs)
        assert caught.value.body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }


def test_every_route_answers_errors_in_its_dialects_envelope(gw):
    """Routing, auth, the body limit and the app's handlers all pick the envelope from the route's
    dialect (`routes.error_body`), matched before routing for the body limit."""
    base = session_url(gw)
    big = b'{"x": "' + b"y" * 5000 + b'"}'
    for route, anthropic_shape in (
        ("chat/completions", False),
        ("completions", False),
        ("responses", False),
        ("messages", True),
        ("messages/count_tokens", True),
    ):
        for r in (
            httpx.post(f"{base}/{route}", content=big, headers={**KEY, "content-type": "application/json"}),
            httpx.post(f"{base}/{route}", json={}),  # no key: refused by the route's dependency
        ):
            assert r.status_code in (401, 413), r.text
            body = r.json()
            if anthropic_shape:
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, r.text
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}, r.text
    scope = {"type": "http", "method": "POST", "path": "/s/abc/v1/messages", "root_path": "", "app": gw.app}
    exc = GatewayError("'top_k' must be between 1 and 5; got 9", param="top_k")
    assert error_body(scope, exc)["error"]["message"] == "top_k: must be between 1 and 5; got 9"
    assert error_body({**scope, "path": "/s/abc/v1/responses"}, exc) == exc.body()
    assert error_body({**scope, "path": "/sessions"}, exc) == exc.body()  # no dialect: OpenAI's
