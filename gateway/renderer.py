"""Chat rendering: OpenAI messages -> the model's chat template -> token ids.

The gateway renders with the tokenizer's own chat template (`apply_chat_template`, jinja), so any
HF model works with its real template (Qwen, GLM, DeepSeek, Llama ...). docs/gateway.md explains
why this and not the `renderers` package.

Messages are normalised first, the way the templates expect them:
* content given as a list of text parts becomes one string (any role, system included);
* `content: null` stays None (templates test for it);
* tool-call `arguments` arrive from OpenAI clients as JSON *strings*; templates serialise them with
  `tojson`, so they are parsed to objects (a string that is not JSON is left as it is).
Each normalised message also gets a canonical digest, used to find a session's earlier calls whose
message list is a prefix of the new one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from palaestra.gateway.errors import GatewayError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                raise GatewayError(
                    f"{where}: content part type {part.get('type')!r} is not supported (text only)"
                )
            else:
                raise GatewayError(f"{where}: content parts must be objects")
        return "".join(parts)
    raise GatewayError(f"{where}: content must be a string, a list of text parts, or null")


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise GatewayError("'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise GatewayError(f"{where} must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise GatewayError(
                f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param="messages"
            )
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text(m.get("content"), where),
        }
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise GatewayError(f"{where}.tool_calls must be an array", param="messages")
            norm_calls = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise GatewayError(f"{where}.tool_calls[{j}] needs function.name", param="messages")
                norm_calls.append(
                    {
                        "id": call.get("id"),
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))},
                    }
                )
            if norm_calls:
                msg["tool_calls"] = norm_calls
            if m.get("reasoning_content"):
                msg["reasoning_content"] = str(m["reasoning_content"])
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
            if m.get("name") is not None:
                msg["name"] = str(m["name"])
        if msg["content"] is None and role != "assistant":
            msg["content"] = ""
        out.append(msg)
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise GatewayError("'tools' must be an array", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise GatewayError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GatewayError(f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise GatewayError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return tools or None


def message_digest(msg: dict[str, Any], *, loose_assistant: bool = False) -> bytes:
    """Canonical digest of a normalised message (tool-call ids are not part of it: clients rewrite them)."""
    if msg["role"] == "assistant":
        content = msg.get("content") or ""
        body = {
            "role": "assistant",
            "content": content.strip() if loose_assistant else content,
            "tool_calls": [
                [c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls", [])
            ],
        }
    else:
        body = {k: v for k, v in msg.items() if k != "tool_call_id"}
    return hashlib.blake2b(
        json.dumps(body, sort_keys=True, ensure_ascii=False).encode(), digest_size=16
    ).digest()


def chain_digests(messages: list[dict[str, Any]]) -> list[bytes]:
    """d[i] identifies messages[: i + 1] (a hash chain, so prefix equality is one comparison)."""
    out, prev = [], b""
    for m in messages:
        prev = hashlib.blake2b(prev + message_digest(m), digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class ChatRenderer:
    tokenizer: Any
    template_kwargs: dict[str, Any] | None = None

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        kwargs = {**(self.template_kwargs or {}), **(extra or {})}
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # a template error is the request's fault (bad roles/order/schema)
            raise GatewayError(f"the chat template rejected these messages: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
