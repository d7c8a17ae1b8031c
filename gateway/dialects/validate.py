"""The field checks every dialect's parser shares: numbers in a range, and stop-string lists.

    temperature = number(body, "temperature", 0, 2)            # None when absent
    n = number(body, "n", 1, MAX_N, integer=True) or 1
    stops = stop_list(body, "stop", one_string=True)          # [] when absent

Each refusal is a 400 `GatewayError` naming the field (`param`) in OpenAI's words ("'n' must be
between 1 and 64; got 100"); a dialect with another envelope rewrites the wording in its error
shape (`Dialect.error_body`: Anthropic's messages start "n: ..."). Refusals carry the codes
OpenAI's API gives the same mistakes — ``invalid_type``, ``integer_above_max_value``,
``integer_below_min_value``, ``decimal_above_max_value``, ``decimal_below_min_value`` — which the
OpenAI envelope (chat, completions, Responses) answers and Anthropic's, having no code, leaves out.
"""

from __future__ import annotations

import math
from typing import Any

from palaestra.gateway.errors import GatewayError
from palaestra.gateway.streaming import MAX_STOP_CHARS

__all__ = ["MAX_NEW_TOKENS", "MAX_STOPS", "SEED_RANGE", "number", "stop_list"]

MAX_STOPS = 16
"""Most stop strings one call may set, in every dialect (each is checked on every streamed token)."""

MAX_NEW_TOKENS = (1 << 31) - 1
"""Largest turn budget (max_tokens, max_output_tokens) any dialect takes: far past every context, so
only a typo or a fuzzer meets it; a budget past the context but under it is clamped to the context,
or refused (option max_tokens_over_context). Without a bound `1e308` would be read as an integer of
1024 bits that no engine, nor the answer's JSON, can carry."""

SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
"""A sampling seed is a signed 64-bit integer (the engines seed a torch generator with it)."""


def number(body: dict[str, Any], key: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    """`body[key]` as a float (an int with `integer`: 2.0 is 2) within [lo, hi]; None when absent
    or null. A boolean is not a number, nor is a float with a fraction an integer."""
    value = body.get(key)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and isinstance(value, float) and not value.is_integer())  # inf and nan too
    ):
        raise GatewayError(f"'{key}' must be {kind}", param=key, code="invalid_type")
    if not lo <= value <= hi:  # (nan fails both comparisons: a number out of every range)
        side = "above_max_value" if value > hi else "below_min_value"
        code = f"{'integer' if integer else 'decimal'}_{side}"
        allowed = f"at least {lo}" if hi == math.inf else f"between {lo} and {hi}"
        raise GatewayError(f"'{key}' must be {allowed}; got {value}", param=key, code=code)
    return int(value) if integer else float(value)


def stop_list(body: dict[str, Any], key: str, *, one_string: bool = False) -> list[str]:
    """`body[key]`: an array of up to `MAX_STOPS` strings, each at most `MAX_STOP_CHARS` characters
    ([] when absent or null). `one_string` (OpenAI chat and completions): a single string is a list
    of one, and empty strings are dropped; otherwise (Responses, Anthropic) an empty one is refused."""
    stops = body.get(key)
    if stops is None:
        return []
    if one_string and isinstance(stops, str):
        stops = [stops]
    ok_item = (lambda s: isinstance(s, str)) if one_string else (lambda s: isinstance(s, str) and s)
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(ok_item(s) for s in stops):
        what = "a string or an array" if one_string else "an array"
        strings = "strings" if one_string else "non-empty strings"
        raise GatewayError(f"'{key}' must be {what} of up to {MAX_STOPS} {strings}", param=key)
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise GatewayError(
                f"'{key}' strings may be at most {MAX_STOP_CHARS} characters; got one of {len(s)}",
                param=key,
            )
    return [s for s in stops if s]
