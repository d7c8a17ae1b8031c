"""JSON Schemas of the request bodies, for the gateway's OpenAPI document only.

The routes read their bodies as raw JSON and each dialect's parser checks every field itself
(`openai_request.py`, `responses_api.py`, `anthropic_api.py`): per-request pydantic models would
cost more than the rest of a call's routing. So FastAPI cannot derive the bodies' shapes; these
hand-written schemas go into `/openapi.json` through each route's `openapi_extra` (`body`), and
nothing validates a request against them. They describe what the parsers accept, so that clients
and fuzzers (schemathesis, tests/gateway/test_fuzz.py) see real bodies; the parsers stay the
authority, and a body the schema allows but a parser refuses gets a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from palaestra.gateway.dialects.validate import MAX_STOPS
from palaestra.gateway.streaming import MAX_STOP_CHARS

__all__ = [
    "ANTHROPIC_COUNT",
    "ANTHROPIC_MESSAGES",
    "CHAT",
    "COMPLETIONS",
    "RESPONSES",
    "REWARD",
    "SESSION",
    "body",
]

_STR = {"type": "string"}
_OBJ = {"type": "object"}
_STOP = {"type": "string", "maxLength": MAX_STOP_CHARS}
_SAMPLING = {
    "model": _STR,
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "stream": {"type": "boolean"},
}
_OPENAI_SAMPLING = {
    **_SAMPLING,
    "max_tokens": {"type": "integer", "minimum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 64},
    "stop": {"oneOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOPS}]},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 2},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number"}},
    "user": _STR,
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "metadata": _OBJ,
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"enum": ["text", "input_text", "output_text"]}, "text": _STR},
    "required": ["type", "text"],
}
_CHAT_TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": _STR,
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1}, "arguments": _STR},
            "required": ["name"],
        },
    },
    "required": ["function"],
}
_CHAT_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": _CHAT_TOOL_CALL},
        "tool_call_id": _STR,
        "name": _STR,
        "reasoning_content": _STR,
    },
    "required": ["role"],
}
_FUNCTION = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1}, "description": _STR, "parameters": _OBJ},
    "required": ["name"],
}
_FORMAT = {
    "type": "object",
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
    "required": ["type"],
}

CHAT: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_OPENAI_SAMPLING,
        "messages": {"type": "array", "items": _CHAT_MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION},
                "required": ["type", "function"],
            },
        },
        "tool_choice": {
            "oneOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "properties": {
                        "type": {"enum": ["function"]},
                        "function": {"type": "object", "properties": {"name": _STR}, "required": ["name"]},
                    },
                    "required": ["type", "function"],
                },
            ]
        },
        "parallel_tool_calls": {"type": "boolean"},
        "response_format": _FORMAT,
        "chat_template_kwargs": _OBJ,
    },
    "required": ["messages"],
    "additionalProperties": False,
}

COMPLETIONS: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_OPENAI_SAMPLING,
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _STR}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "echo": {"type": "boolean"},
    },
    "required": ["prompt"],
    "additionalProperties": False,
}

_RESPONSES_ITEM = {
    "type": "object",
    "properties": {
        "type": {"enum": ["message", "reasoning", "function_call", "function_call_output"]},
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
        "name": _STR,
        "call_id": _STR,
        "arguments": _STR,
        "output": _STR,
    },
}
RESPONSES: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_SAMPLING,
        "input": {"oneOf": [_STR, {"type": "array", "items": _RESPONSES_ITEM, "minItems": 1}]},
        "instructions": _STR,
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "previous_response_id": _STR,
        "store": {"type": "boolean"},
        "stop": {"type": "array", "items": {**_STOP, "minLength": 1}, "maxItems": MAX_STOPS},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "include": {"type": "array", "items": {"enum": ["message.output_text.logprobs"]}},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "type": {"enum": ["function"]},
                    "name": {"type": "string", "minLength": 1},
                    "description": _STR,
                    "parameters": _OBJ,
                },
                "required": ["type", "name"],
            },
        },
        "tool_choice": {
            "oneOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "properties": {"type": {"enum": ["function"]}, "name": _STR},
                    "required": ["type", "name"],
                },
            ]
        },
        "text": {"type": "object", "properties": {"format": _FORMAT}},
        "truncation": {"enum": ["disabled"]},
        "metadata": _OBJ,
        "chat_template_kwargs": _OBJ,
    },
    "required": ["input"],
    "additionalProperties": False,
}

_ANTHROPIC_BLOCK = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "thinking", "tool_use", "tool_result"]},
        "text": _STR,
        "thinking": _STR,
        "id": _STR,
        "name": _STR,
        "input": _OBJ,
        "tool_use_id": _STR,
        "content": {"oneOf": [_STR, {"type": "array", "items": {"type": "object"}}]},
    },
    "required": ["type"],
}
_ANTHROPIC_CHAT = {
    "model": _STR,
    "system": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
    "messages": {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "properties": {
                "role": {"enum": ["user", "assistant"]},
                "content": {"oneOf": [_STR, {"type": "array", "items": _ANTHROPIC_BLOCK}]},
            },
            "required": ["role", "content"],
        },
    },
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": _STR,
                "input_schema": _OBJ,
            },
            "required": ["name", "input_schema"],
        },
    },
    "tool_choice": {
        "type": "object",
        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": _STR},
        "required": ["type"],
    },
    "thinking": {
        "type": "object",
        "properties": {"type": {"enum": ["enabled", "disabled"]}, "budget_tokens": {"type": "integer"}},
        "required": ["type"],
    },
}
ANTHROPIC_MESSAGES: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_ANTHROPIC_CHAT,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": {**_STOP, "minLength": 1}, "maxItems": MAX_STOPS},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "metadata": _OBJ,
    },
    "required": ["messages", "max_tokens"],
    "additionalProperties": False,
}
ANTHROPIC_COUNT: dict[str, Any] = {
    "type": "object",
    "properties": _ANTHROPIC_CHAT,
    "required": ["messages"],
    "additionalProperties": False,
}

SESSION: dict[str, Any] = {
    "type": "object",
    "properties": {
        "env": _STR,
        "task_id": _STR,
        "group_id": _STR,
        "session_id": {"type": "string", "pattern": "^[A-Za-z0-9-]+$"},
        "metadata": _OBJ,
        "sampling": {  # gateway/sessions/sampling.py: applied to every call of the session
            "type": "object",
            "properties": {
                **{k: {"type": "number"} for k in ("temperature", "top_p", "min_p", "repetition_penalty")},
                **{k: {"type": "number"} for k in ("presence_penalty", "frequency_penalty")},
                "top_k": {"type": "integer"},
                "seed": {"type": "integer"},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
REWARD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "reward": {"type": "number"},
        "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
        "status": {"enum": ["completed", "truncated", "aborted", "failed"]},
        "done": {"enum": [True]},
    },
    "required": ["reward"],
    "additionalProperties": False,
}


def body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON request body described by `schema`."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}
