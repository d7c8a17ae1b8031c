"""Parsing and validation of SGLang-native `/generate` requests.

Field names, defaults and ranges follow SGLang (docs/engine-protocol.md, "/generate").
Where SGLang is lax we are strict on purpose, and docs/engine.md says so: an unknown key, at the
top level or inside `sampling_params`, is a 400 with the key's name (SGLang ignores unknown
top-level keys and answers 500 for unknown sampling keys); a known SGLang feature that the
embedded engine does not implement is a 400 naming the feature, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any


class RequestError(ValueError):
    """A client error: the HTTP layer answers `status` with the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """The JSON body of an error answer: both SGLang shapes at once, the validation one (top-level)
    and the handler one (`error`)."""
    return {
        "object": "error",
        "message": message,
        "type": "BadRequestError" if status < 500 else "InternalServerError",
        "code": status,
        "error": {"message": message, "code": status},
    }


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None
    json_schema: str | None = None  # constrained decoding (engine/grammar.py): at most one of these
    regex: str | None = None
    ebnf: str | None = None


# SGLang sampling keys we accept only when unset (json_schema / regex / ebnf are served by
# engine/grammar.py; structural tags and custom logit processors are not).
_UNSUPPORTED_SAMPLING = ("structural_tag", "custom_params")
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Model-dependent defaults (SGLang's `--sampling-defaults model`): read from generation_config.json.
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

_TOP_LEVEL = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "return_prompt_token_ids",
    # accepted and ignored: they steer scheduling/routing/logging, not results
    "routing_key",
    "priority",
    "log_metrics",
    "no_logs",
    "custom_labels",
    "extra_key",
    "data_parallel_rank",
    "conversation_id",
    "background",
    "model",  # sglang-router 0.3.2 re-serialises /generate bodies with "model": null
    "lora_path",  # the name of a loaded LoRA adapter (engine/lora.py), or one per prompt
    "return_routed_experts",  # MoE models under --enable-return-routed-experts (engine/model_runner.py)
    "routed_experts_start_len",
}
# Known SGLang fields the embedded engine does not implement: accepted only when unset.
_UNSUPPORTED_TOP_LEVEL = {
    "input_embeds",
    "image_data",
    "audio_data",
    "video_data",
    "lora_id",
    "session_params",
    "session_id",
    "return_hidden_states",
    "custom_logit_processor",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "modalities",
    "return_entropy",
    "return_bytes",
}


def _num(
    name: str, value: Any, kind: type, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"sampling_params.{name} must be a number, got {value!r}")
    if kind is int and not float(value).is_integer():
        raise RequestError(f"sampling_params.{name} must be an integer, got {value!r}")
    value = kind(value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise RequestError(
            f"sampling_params.{name}={value} is out of range ({'>' if lo_open else '>='} {lo})"
        )
    if hi is not None and value > hi:
        raise RequestError(f"sampling_params.{name}={value} is out of range (<= {hi})")
    return value


def _str_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise RequestError(f"sampling_params.{name} must be a string or a list of strings")


def parse_sampling(raw: Any, defaults: dict[str, Any], vocab_size: int) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError("sampling_params must be an object")
    for key, value in raw.items():
        if key in _UNSUPPORTED_SAMPLING:
            if value is not None:
                raise RequestError(f"sampling_params.{key} is not supported by the embedded engine")
        elif key not in _SAMPLING_FIELDS:
            raise RequestError(f"unknown sampling_params field {key!r}")
    # explicit null means "default", as in SGLang
    given = {k: v for k, v in raw.items() if v is not None and k in _SAMPLING_FIELDS}
    merged = {**{k: v for k, v in defaults.items() if k in MODEL_DEFAULT_KEYS}, **given}
    p = SamplingParams()
    if "max_new_tokens" in merged:
        p.max_new_tokens = _num("max_new_tokens", merged["max_new_tokens"], int, 0)
    if "temperature" in merged:
        p.temperature = _num("temperature", merged["temperature"], float, 0)
    if "top_p" in merged:
        p.top_p = _num("top_p", merged["top_p"], float, 0, 1, lo_open=True)
    if "top_k" in merged:
        p.top_k = _num("top_k", merged["top_k"], int)
        if p.top_k == 0 or p.top_k < -1:
            raise RequestError("sampling_params.top_k must be -1 (whole vocabulary) or >= 1")
    if "min_p" in merged:
        p.min_p = _num("min_p", merged["min_p"], float, 0, 1)
    if "repetition_penalty" in merged:
        p.repetition_penalty = _num(
            "repetition_penalty", merged["repetition_penalty"], float, 0, 2, lo_open=True
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if name in merged:
            setattr(p, name, _num(name, merged[name], float, -2, 2))
    if "min_new_tokens" in merged:
        p.min_new_tokens = _num("min_new_tokens", merged["min_new_tokens"], int, 0)
        if p.min_new_tokens > p.max_new_tokens:
            raise RequestError("sampling_params.min_new_tokens must be <= max_new_tokens")
    p.stop = _str_list("stop", merged.get("stop"))
    p.stop_regex = _str_list("stop_regex", merged.get("stop_regex"))
    if "stop_token_ids" in merged:
        ids = merged["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError("sampling_params.stop_token_ids must be a list of integers")
        _check_ids("sampling_params.stop_token_ids", ids, vocab_size)
        p.stop_token_ids = list(ids)
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if name in merged:
            if not isinstance(merged[name], bool):
                raise RequestError(f"sampling_params.{name} must be a boolean")
            setattr(p, name, merged[name])
    if "n" in merged:
        p.n = _num("n", merged["n"], int, 1, 64)
    if "logit_bias" in merged:
        bias = merged["logit_bias"]
        if not isinstance(bias, dict):
            raise RequestError("sampling_params.logit_bias must be an object {token_id: bias}")
        try:
            p.logit_bias = {str(int(k)): float(v) for k, v in bias.items()}
        except (TypeError, ValueError) as exc:
            raise RequestError(f"sampling_params.logit_bias: {exc}") from None
        _check_ids("sampling_params.logit_bias", [int(k) for k in p.logit_bias], vocab_size)
    if "sampling_seed" in merged:
        p.sampling_seed = _num("sampling_seed", merged["sampling_seed"], int)
    if "stream_interval" in merged:
        p.stream_interval = _num("stream_interval", merged["stream_interval"], int, 1)
    for name in ("json_schema", "regex", "ebnf"):
        if name in merged:
            if not isinstance(merged[name], str) or not merged[name]:
                raise RequestError(f"sampling_params.{name} must be a non-empty string")
            setattr(p, name, merged[name])
    return p


def _check_ids(what: str, ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"{what}: token ids out of vocabulary (size {vocab_size}): {bad[:8]}")


@dataclass
class PromptSpec:
    """One prompt x one sample, after batch and `n` expansion."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    index: int  # position in the expanded batch (stream `index`)
    lora_path: str | None = None  # the LoRA adapter's name (SGLang's lora_path); None: the base model
    return_routed_experts: bool = False  # answer meta_info.routed_experts (SGLang's format)
    routed_experts_start_len: int = 0  # the first position whose routing is returned, in [0, prompt]


@dataclass
class GenerateRequest:
    specs: list[PromptSpec]
    batched: bool  # the answer is a JSON array
    stream: bool


def _per_item(value: Any, i: int, count: int, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {count}")
        return value[i]
    return value


def parse_generate(
    body: Any,
    *,
    tokenize,
    vocab_size: int,
    context_length: int,
    defaults: dict[str, Any],
    routed_experts_unavailable: str | None = None,
) -> GenerateRequest:
    """Validates a `/generate` body and expands it into one PromptSpec per sequence to sample.

    `routed_experts_unavailable` says why this server cannot return routed experts (a dense model,
    or no --enable-return-routed-experts); None: it can."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_keys(body)
    prompts, batched = _prompts(body, tokenize, vocab_size)
    options = _Options.parse(body, vocab_size, routed_experts_unavailable)
    specs: list[PromptSpec] = []
    raw_sampling = body.get("sampling_params")
    for i, ids in enumerate(prompts):
        params = parse_sampling(
            _per_item(raw_sampling, i, len(prompts), "sampling_params"), defaults, vocab_size
        )
        _check_length(ids, params, options.logprob_start_len, context_length)
        if options.routed_experts_start_len > len(ids):
            raise RequestError(
                f"routed_experts_start_len ({options.routed_experts_start_len}) is beyond the prompt "
                f"({len(ids)} tokens)"
            )
        specs += options.specs(i, len(prompts), ids, params, batched, first_index=len(specs))
    return GenerateRequest(specs=specs, batched=batched or len(specs) > 1, stream=options.stream)


def _check_keys(body: dict[str, Any]) -> None:
    """Unknown top-level keys, and set ones the embedded engine does not implement, are a 400."""
    for key, value in body.items():
        if key in _UNSUPPORTED_TOP_LEVEL:
            if value not in (None, False, [], {}, 0, ""):
                raise RequestError(f"{key!r} is not supported by the embedded engine")
        elif key not in _TOP_LEVEL:
            raise RequestError(f"unknown field {key!r}")


def _prompts(body: dict[str, Any], tokenize, vocab_size: int) -> tuple[list[list[int]], bool]:
    """The prompts as token ids (`text` tokenized), and whether the body was a batch."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        batched = isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        for ids in prompts:
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise RequestError("input_ids must hold non-empty lists of integers")
            _check_ids("input_ids", ids, vocab_size)
        return prompts, batched
    batched = isinstance(text, list)
    texts = text if batched else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError("text must be a string or a non-empty list of strings")
    prompts = [tokenize(t) for t in texts]
    if any(not ids for ids in prompts):
        raise RequestError("text tokenizes to an empty prompt")
    return prompts, batched


def _check_length(
    ids: list[int], params: SamplingParams, logprob_start_len: int, context_length: int
) -> None:
    if len(ids) >= context_length:
        raise RequestError(f"the prompt has {len(ids)} tokens; the context length is {context_length} tokens")
    if len(ids) + params.max_new_tokens > context_length:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"context length of {context_length} tokens"
        )
    if logprob_start_len > len(ids):
        raise RequestError(
            f"logprob_start_len ({logprob_start_len}) is beyond the prompt ({len(ids)} tokens)"
        )


@dataclass
class _Options:
    """The body's fields besides the prompts and sampling: one value, or one per prompt."""

    body: dict[str, Any]
    rid: Any
    stream: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    lora_path: Any
    return_routed_experts: bool
    routed_experts_start_len: int

    @classmethod
    def parse(cls, body: dict[str, Any], vocab_size: int, routed_experts_unavailable: str | None) -> _Options:
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, (str, list)):
            raise RequestError("rid must be a string or a list of strings")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean")
        start = body.get("logprob_start_len", -1)
        top_n = body.get("top_logprobs_num", 0) or 0
        if not isinstance(start, int) or isinstance(start, bool):
            raise RequestError("logprob_start_len must be an integer")
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise RequestError("top_logprobs_num must be a non-negative integer")
        ids_lp = body.get("token_ids_logprob")
        if ids_lp is not None:
            if not isinstance(ids_lp, list) or not all(isinstance(i, int) for i in ids_lp):
                raise RequestError("token_ids_logprob must be a list of integers")
            _check_ids("token_ids_logprob", ids_lp, vocab_size)
        lora = body.get("lora_path")
        if lora is not None and not (
            isinstance(lora, str)
            or (isinstance(lora, list) and all(x is None or isinstance(x, str) for x in lora))
        ):
            raise RequestError("lora_path must be an adapter name, or a list of names (or null) per prompt")
        routed = body.get("return_routed_experts", False)
        if not isinstance(routed, bool):
            raise RequestError("return_routed_experts must be a boolean")
        if routed and routed_experts_unavailable is not None:
            raise RequestError(f"return_routed_experts: {routed_experts_unavailable}")
        routed_start = body.get("routed_experts_start_len", 0)
        if routed_start is None:
            routed_start = 0
        if not isinstance(routed_start, int) or isinstance(routed_start, bool) or routed_start < 0:
            raise RequestError("routed_experts_start_len must be a non-negative integer")
        return cls(body, rid, stream, start, top_n, ids_lp, lora, routed, routed_start)

    def specs(
        self, i: int, count: int, ids: list[int], params: SamplingParams, batched: bool, first_index: int
    ) -> list[PromptSpec]:
        """Prompt `i` of `count`, one PromptSpec per sample (`n`), with its own rid."""
        rid = self.rid
        item_rid = _per_item(rid, i, count, "rid") if isinstance(rid, list) else rid
        base = item_rid if item_rid is not None else uuid.uuid4().hex
        if isinstance(rid, str) and (batched or params.n > 1):
            base = f"{rid}_{i}"
        return_logprob = bool(_per_item(self.body.get("return_logprob", False), i, count, "return_logprob"))
        item_lora = _per_item(self.lora_path, i, count, "lora_path") or None
        return [
            PromptSpec(
                rid=base if params.n == 1 else f"{base}_{j}",
                input_ids=list(ids),
                params=params,
                return_logprob=return_logprob,
                logprob_start_len=self.logprob_start_len,
                top_logprobs_num=self.top_logprobs_num,
                token_ids_logprob=self.token_ids_logprob,
                return_text_in_logprobs=bool(self.body.get("return_text_in_logprobs", False)),
                return_prompt_token_ids=bool(self.body.get("return_prompt_token_ids", False)),
                index=first_index + j,
                lora_path=item_lora,
                return_routed_experts=self.return_routed_experts,
                routed_experts_start_len=self.routed_experts_start_len,
            )
            for j in range(params.n)
        ]
