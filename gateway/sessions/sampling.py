"""A session's sampling: what the run chose at session creation, applied by the gateway to every call.

    POST /sessions {"env": "math", "sampling": {"temperature": 0.0, "seed": 1234}}

The environment runner (`palaestra.sdk.runner.run_rollouts`: `palaestra eval` greedy, `palaestra
train` at the trainer's temperature) sends the sampling it hands the environment as
`session.sampling`, under the chat completions field names. An environment is meant to pass it on
every call (`create(..., **session.sampling)`); one that forgets would sample at the API's default
(temperature 1) while the run reports "greedy". So, on every call of the session, in every dialect:

* a field the call omits takes the session's value (Messages has no `seed`: the session's applies);
* a field the call sets to another value is *contradicted*: the session's value is used, the call's
  is recorded on the turn as an ignored control (``temperature=1.0 (session sampling 0.0)``, counted
  in the session record's `ignored_controls` and in `palaestra_gateway_ignored_controls_total`),
  counted in `palaestra_gateway_sampling_contradicted_total`, and logged once per session.

The session's value wins because the run's numbers depend on it: the trainer's logprobs are only
right at its temperature, and an evaluation called greedy must be. A session created without
`sampling` (an external agent, `palaestra session new`) is left to its calls.
"""

from __future__ import annotations

import math
from typing import Any

from palaestra.gateway.dialects.validate import SEED_RANGE
from palaestra.gateway.errors import GatewayError

__all__ = ["FIELDS", "apply", "parse"]

FIELDS: dict[str, tuple[str, float, float, bool]] = {
    "temperature": ("temperature", 0, 2, False),
    "top_p": ("top_p", 0, 1, False),
    "top_k": ("top_k", -1, 1 << 30, True),
    "min_p": ("min_p", 0, 1, False),
    "presence_penalty": ("presence_penalty", -2, 2, False),
    "frequency_penalty": ("frequency_penalty", -2, 2, False),
    "repetition_penalty": ("repetition_penalty", 0.01, 2, False),
    "seed": ("sampling_seed", *SEED_RANGE, True),
}
"""A session sampling field (the chat completions name, which is also each dialect's name where it
has the field) -> (SGLang's `sampling_params` name, least, greatest, integer)."""


def parse(value: Any) -> dict[str, Any]:
    """POST /sessions' `sampling`: an object of `FIELDS`, each a number in its range (400 otherwise,
    naming the field and what it takes). None or absent: {}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise GatewayError("'sampling' must be an object, e.g. {\"temperature\": 0.0}", param="sampling")
    out: dict[str, Any] = {}
    for key, given in value.items():
        if key not in FIELDS:
            raise GatewayError(
                f"'sampling.{key}' is not a sampling field; the fields are: {', '.join(FIELDS)}",
                param=f"sampling.{key}",
            )
        _, lo, hi, integer = FIELDS[key]
        number = isinstance(given, int) if integer else isinstance(given, (int, float))
        if isinstance(given, bool) or not number or not math.isfinite(given) or not lo <= given <= hi:
            kind = "an integer" if integer else "a number"
            raise GatewayError(
                f"'sampling.{key}' must be {kind} in [{lo:g}, {hi:g}]; got {given!r}", param=f"sampling.{key}"
            )
        out[key] = given
    return out


def apply(session_sampling: dict[str, Any], body: dict[str, Any], sampling: dict[str, Any]) -> list[str]:
    """Puts the session's sampling into a call's parsed SGLang `sampling` (the call's `body` tells
    what it set); returns the contradicted fields as ignored-control names (module docstring)."""
    contradicted = []
    for key, value in session_sampling.items():
        name = FIELDS[key][0]
        given = body.get(key)
        if given is not None and given != value:
            contradicted.append(f"{key}={given!r} (session sampling {value!r})")
        sampling[name] = max(value, 1e-6) if key == "top_p" else value  # as the dialects map top_p 0
    return contradicted
