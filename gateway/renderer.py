"""Chat rendering: OpenAI messages -> the model's chat template -> token ids.

The gateway renders with the tokenizer's own chat template (`apply_chat_template`, jinja), so any
HF model works with its real template (Qwen, GLM, DeepSeek, Llama ...). docs/gateway.md explains
why this and not the `renderers` package.

Messages are normalised first, the way the templates expect them:
* content given as a list of text parts becomes one string (any role, system included);
* `content: null` becomes "" (Qwen templates treat both alike; GLM's would print "None");
* tool-call `arguments` arrive from OpenAI clients as JSON *strings*; templates serialise them with
  `tojson`, so they are parsed to objects (a string that is not JSON is left as it is).
Each normalised message also gets a canonical digest, used to find a session's earlier calls whose
message list is a prefix of the new one.
"""

from __future__ import annotations

import builtins
import os
import unicodedata
from typing import Any

from palaestra.gateway.errors import GatewayError
from palaestra.gateway.guards import json_or_text

ROLES = ("system", "developer", "user", "assistant", "tool")
_PLAIN = ("system", "user", "assistant")  # roles a {role, content: str} message keeps as it is


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                if not isinstance(part.get("text", ""), str):
                    raise GatewayError(f"{where}: a text part's 'text' must be a string", param="messages")
                parts.append(part.get("text", ""))
            elif isinstance(part, dict):
                raise GatewayError(
                    f"{where}: content part type {part.get('type')!r} is not supported (text only)",
                    param="messages",
                )
            else:
                raise GatewayError(f"{where}: content parts must be objects", param="messages")
        return "".join(parts)
    raise GatewayError(f"{where}: content must be a string, a list of text parts, or null", param="messages")


def _arguments(value: Any) -> Any:
    return json_or_text(value) if isinstance(value, str) else value  # not JSON, or too deep: text


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise GatewayError("'messages' must be a non-empty array", param="messages")
    return normalize_more(messages)


def normalize_more(messages: list[Any], offset: int = 0) -> list[dict[str, Any]]:
    """`normalize_messages` of messages that follow `offset` others (errors name their position);
    an empty list is fine here."""
    out = []
    for i, m in enumerate(messages, offset):
        # the common case first, with no copy: this loop runs over the whole history on every call
        if type(m) is dict and len(m) == 2 and type(m.get("content")) is str and m.get("role") in _PLAIN:
            out.append(m)
            continue
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
        if msg["content"] is None:  # GLM templates print a None content as the text "None"
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
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise GatewayError(f"tools[{i}].function.description must be a string", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise GatewayError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return tools or None


def message_digest(msg: dict[str, Any], *, loose_assistant: bool = False) -> int:
    """Digest of a normalised message; tool-call ids are left out (clients rewrite them).

    Python's tuple hash (64-bit, C speed): this runs over every message of every request, so it must
    be cheap. A collision would only make the gateway consider a wrong earlier turn as the parent;
    `bridge.plan_chat` re-checks the template rendering of the shared history, so it would fork, not
    silently mix.
    """
    if msg["role"] == "assistant":
        content = msg.get("content") or ""
        calls = tuple(
            (c["function"]["name"], repr(c["function"]["arguments"])) for c in msg.get("tool_calls", ())
        )
        return hash(("assistant", content.strip() if loose_assistant else content, calls))
    return hash((msg["role"], msg.get("content"), msg.get("name")))


def chain_digests(messages: list[dict[str, Any]], prev: int = 0) -> list[int]:
    """d[i] identifies messages[: i + 1] (a hash chain, so prefix equality is one comparison);
    `prev`: the digest of the messages before these (0: none)."""
    out = []
    for m in messages:
        # message_digest inlined for the common cases: this runs over the whole history per call
        role = m["role"]
        if role != "assistant":
            prev = hash((prev, hash((role, m.get("content"), m.get("name")))))
        elif "tool_calls" not in m:
            prev = hash((prev, hash(("assistant", m.get("content") or "", ()))))
        else:
            prev = hash((prev, message_digest(m)))
        out.append(prev)
    return out


class HistoryDigests:
    """`chain_digests` of a session's calls, reusing the previous call's work on the history the new
    call repeats (an agent sends its whole history every call; usually the last call's messages,
    the reply and something new).

    The repeated prefix is found by comparing the message lists with `==` (in C, much cheaper than
    digesting them in Python), then checked exactly where `==` is looser than the digest: tool-call
    arguments, where 1 == 1.0 == True but the template prints them differently. The matched prefix
    is replaced by the previous call's message objects, so what a session keeps (Responses
    conversations) shares one copy of its history instead of one per call, which keeps the garbage
    collector's work per call from growing with the history. Only a cache: a call that repeats
    nothing is digested in full, as by `chain_digests`."""

    __slots__ = ("_messages", "_digests", "_calls")

    def __init__(self) -> None:
        self._messages: list[dict[str, Any]] = []
        self._digests: list[int] = []
        self._calls: list[int] = []  # indices of the messages with tool calls

    def of(self, messages: list[dict[str, Any]]) -> list[int]:
        """Digests of `messages` (as `chain_digests`); the repeated prefix of `messages` is replaced
        in place by the previous call's equal message objects."""
        known, n = self._messages, len(self._messages)
        start = 0
        if n and n <= len(messages) and messages[:n] == known:
            if all(message_digest(messages[i]) == message_digest(known[i]) for i in self._calls):
                start = n
                messages[:n] = known
        digests = self._digests[:start] + chain_digests(
            messages[start:], self._digests[start - 1] if start else 0
        )
        calls = self._calls if start else []
        self._calls = calls + [i for i in range(start, len(messages)) if "tool_calls" in messages[i]]
        self._messages, self._digests = messages, digests
        return digests


_MEMO_ATTRIBUTE_CHECKS = 4096
"""Most (type, attribute) answers a renderer keeps: the names come from the template's text, except
where a template subscripts with a name from the messages (then each new name is checked as before)."""


def _attribute_checks_memoised(compiled: Any, template: str) -> Any:
    """The template compiled again in an overlay of its environment whose sandbox check of an
    attribute (`is_safe_attribute`, on every `message.content`-style access that finds a Python
    attribute, such as a string's `startswith`) is answered once per (type, attribute name).

    In jinja's `ImmutableSandboxedEnvironment` the answer depends on nothing else: the name (private,
    or a known internal of functions, frames, generators...) and whether the object is of a mutable
    builtin kind that the attribute would modify, both decided by the type. Uncached, those checks
    (abstract-class `isinstance` tests) were two thirds of rendering a short bridge. Any other
    environment class (one that may decide by the value) is left as it is."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = compiled.environment
    if type(env) is not ImmutableSandboxedEnvironment:
        return compiled
    check = env.is_safe_attribute
    answers: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = answers.get(key)
        if safe is None:
            safe = check(obj, attr, value)
            if len(answers) < _MEMO_ATTRIBUTE_CHECKS:
                answers[key] = safe
        return safe

    overlay = env.overlay()  # the same filters, globals and extensions; its own checks
    overlay.is_safe_attribute = is_safe_attribute
    overlay.getattr = _dict_keys_first(overlay)
    overlay.call = _str_methods_called(overlay)
    return overlay.from_string(template)


_DICT_NAMES = frozenset(dir(dict))
"""Every name a plain dict answers as an attribute (its methods, object's): a dict has no instance
attributes, so any other name raises AttributeError."""


def _str_methods_called(env: Any) -> Any:
    """`env.call` (every call a template makes, `content.startswith('<think>')`) that calls a plain
    str's method at once. The sandbox asks whether the callable is safe (a str method is: it carries
    no `unsafe_callable` or `alters_data` mark) and then `Context.call`, which looks for a
    `pass_context`-style mark (a builtin method has none), drops the loop's and block's variables
    from the keywords and calls it; a str method never raises the StopIteration it catches. So the
    answer and any error are the same. Anything else (a filter's callable, a macro, `loop.cycle`,
    a wrapped `str.format`) goes through the sandbox."""
    sandboxed = env.call
    method = type("".strip)

    def call(context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        if type(obj) is method and type(obj.__self__) is str:
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            return obj(*args, **kwargs)
        return sandboxed(context, obj, *args, **kwargs)

    return call


_SCALARS = frozenset({bool, int, float, str, type(None)})
"""Values that are never a bound `str.format` (the one kind of value the sandbox wraps)."""

_STR_NAMES = frozenset(dir(str)) - {"format", "format_map"}
"""The names a plain str answers as an attribute, less the two the sandbox wraps (`wrap_str_format`)."""


def _dict_keys_first(env: Any) -> Any:
    """`env.getattr` (what a template's `message.content` calls) without the sandbox's detours for
    the two kinds a chat template reads most, exactly as the sandbox answers them:

    * a plain dict's key where no attribute of that name exists: the sandbox tries the Python
      attribute first, and for a message's field that raises and catches an AttributeError before
      it reads the key (a `dict`, not a subclass, has no attribute outside `_DICT_NAMES`, so the
      sandbox also ends at `obj[name]`, else `undefined`);
    * a plain str's method (`content.startswith`): the sandbox's format check and safety check,
      whose answer depends on the name only (`env.is_safe_attribute` for a str, asked once per name).

    * a field of jinja's own `loop` and `namespace` objects (`loop.last`, `ns.last_query_index`)
      whose value is a plain scalar: the same safety check, answered once per (type, name); a
      scalar is never a str's `format` method, which the sandbox wraps.

    Half of a whole history's rendering went to those detours. Any other object, name or value
    (`message.items`, a dict subclass, `text.format`, `loop.cycle`) goes through the sandbox's path."""
    from jinja2.runtime import LoopContext
    from jinja2.utils import Namespace

    sandboxed, check = env.getattr, env.is_safe_attribute
    str_safe: dict[str, bool] = {}
    jinja_safe: dict[tuple[type, str], bool] = {}
    jinja_kinds = (LoopContext, Namespace)

    def getattr(obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and type(attribute) is str and attribute not in _DICT_NAMES:
            try:
                return obj[attribute]
            except KeyError:
                return env.undefined(obj=obj, name=attribute)
        if kind is str and type(attribute) is str and attribute in _STR_NAMES:
            safe = str_safe.get(attribute)
            if safe is None:
                safe = str_safe[attribute] = check(obj, attribute, builtins.getattr(obj, attribute))
            if safe:
                return builtins.getattr(obj, attribute)
        elif kind in jinja_kinds and type(attribute) is str:
            try:
                value = builtins.getattr(obj, attribute)
            except AttributeError:
                return sandboxed(obj, attribute)
            if type(value) in _SCALARS:
                key = (kind, attribute)
                safe = jinja_safe.get(key)
                if safe is None:
                    safe = check(obj, attribute, value)
                    if len(jinja_safe) < _MEMO_ATTRIBUTE_CHECKS:
                        jinja_safe[key] = safe
                if safe:
                    return value
        return sandboxed(obj, attribute)

    return getattr


_MEMO_RENDERS = 8
"""Most requests whose rendering and ids a renderer keeps for a repeat (`ChatRenderer.recall`)."""

_IMPURE_NAMES = frozenset({"strftime_now", "lipsum"})  # today's date; random text
_IMPURE_FILTERS = frozenset({"random"})


def _renders_alike(compiled: Any, template: str) -> bool:
    """Whether the template's text depends only on what it is given: it calls none of the globals or
    filters whose answer changes between calls (transformers' `strftime_now`, jinja's `lipsum` and
    `random`). Llama 3's templates print today's date: a repeat of a request may render otherwise."""
    from jinja2 import nodes

    try:
        tree = compiled.environment.parse(template)
    except Exception:
        return False
    for node in tree.find_all((nodes.Name, nodes.Filter)):
        names = _IMPURE_NAMES if isinstance(node, nodes.Name) else _IMPURE_FILTERS
        if node.name in names:
            return False
    return True


class ChatRenderer:
    """Renders with the tokenizer's chat template.

    The template is compiled once, in transformers' own sandboxed jinja environment, and rendered
    directly with the normalised messages (transformers' `apply_chat_template` deep-converts every
    message on every call, which costs more than the rendering itself on long histories). The
    result is identical to `apply_chat_template(..., tokenize=False)`; tests/gateway/test_templates.py
    checks that on real templates. Falls back to `apply_chat_template` if that environment is not
    available in the installed transformers.
    """

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: dict[str, Any] | None = None,
        context_length: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs or {}
        self.context_length = context_length
        # No token of the vocabulary decodes to more characters than its own string has, so a text
        # longer than context x the longest one cannot fit in the context: `encode` refuses it
        # without tokenizing (tokenizing megabytes takes seconds, on the loop serving every session).
        vocab = tokenizer.get_vocab() if context_length and hasattr(tokenizer, "get_vocab") else {}
        self.max_text_chars = context_length * max(map(len, vocab)) if vocab else None
        template = getattr(tokenizer, "chat_template", None)
        self._compiled = None
        if isinstance(template, str):
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self._compiled = _attribute_checks_memoised(_compile_jinja_template(template), template)
            except ImportError:  # other transformers versions: the public (slower) path
                self._compiled = None
        self._memo: dict[str, tuple[str, tuple[int, ...]]] | None = None
        if self._compiled is not None and _renders_alike(self._compiled, template):
            self._memo = {}
        self._backend = _fast_backend(tokenizer)
        self._encode_one = _without_offsets(self._backend)
        self._encode_nfc = _without_nfc(self._backend) if self._encode_one is not None else None
        self.decode_concatenates = _decode_concatenates(self._backend, tokenizer)
        """`decode(ids)` is `decode(ids[:p]) + decode(ids[p:])` wherever the first part's text ends
        on a whole character (no trailing U+FFFD): a byte-level decoder read through the backend.
        A streamed answer then decodes only its new ids (`streaming.HeldBackText`)."""
        self._specials = {
            k: v
            for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
            if isinstance(v, str)
        }

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        kwargs = {**self.template_kwargs, **(extra or {})}
        try:
            if self._compiled is None:
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
            chat = [_aliased(m) for m in messages]
            return self._compiled.render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._specials,
                **kwargs,
            )
        except Exception as exc:  # a template error is the request's fault (bad roles/order/schema)
            raise GatewayError(
                f"the chat template rejected these messages: {exc}", param="messages"
            ) from None

    def memo_key(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, extra: dict[str, Any] | None
    ) -> str | None:
        """What `recall` and `remember` know a request's whole rendering by (None: this template is
        rendered every time, `_renders_alike`). A fork's prompt, rendered and tokenized whole, is
        often one the gateway just rendered: a retry, another sample of the same turn, the first
        calls of a GRPO group's sessions. The key is the request's `repr`: the requests are JSON
        values, whose repr tells 1, 1.0 and True apart and keeps the keys' order, as `tojson` does."""
        return None if self._memo is None else repr((messages, tools, extra))

    def recall(self, key: str | None) -> tuple[str, list[int]] | None:
        """`render(..., True, extra)` of the request `key` names and its `encode` (a copy), if kept."""
        known = self._memo.get(key) if self._memo is not None and key is not None else None
        return None if known is None else (known[0], list(known[1]))

    def remember(self, key: str | None, text: str, ids: list[int]) -> None:
        """Keeps the request's rendering `text` and its ids (copied) for `recall`; the oldest of
        `_MEMO_RENDERS` goes."""
        if self._memo is None or key is None:
            return
        if len(self._memo) >= _MEMO_RENDERS:
            del self._memo[next(iter(self._memo))]
        self._memo[key] = (text, tuple(ids))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included (through the backend when that is the same)."""
        if self._backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise GatewayError(
                f"This model's maximum context length is {self.context_length} tokens. However, your "
                f"messages are {len(text)} characters long, more than {self.context_length} tokens in any "
                "tokenization.",
                code="context_length_exceeded",
                param="messages",
            )
        if self._encode_nfc is not None and unicodedata.is_normalized("NFC", text):
            return self._encode_nfc([text], add_special_tokens=False)[0].ids
        if self._encode_one is not None:
            return self._encode_one([text], add_special_tokens=False)[0].ids
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)


def _without_offsets(backend: Any) -> Any:
    """The backend's `encode_batch_fast` (one text at a time), where it may run in this thread: it
    gives `encode`'s ids without working out each token's character offsets, which nothing here
    reads (a fifth of the time of tokenizing a 1.7k-character tool output with Qwen3's tokenizer,
    about half the gateway CPU of a harness's tool turn: docs/gateway.md). A batch call starts the tokenizers
    library's thread pool unless `TOKENIZERS_PARALLELISM` says not to (`palaestra gateway serve`
    sets it to false unless it is set): a pool of idle threads for one text at a time, and a
    warning in any process forked after it. None: `encode` as before."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() not in ("false", "0", "off", "no"):
        return None
    encode = getattr(backend, "encode_batch_fast", None)
    if encode is None:  # older tokenizers
        return None
    probe = 'Hello, world!\n  {"k": [1, 2]} \u00e9\u4e2d\t\tdef f(x):\n    return x'
    try:
        same = (
            encode([probe], add_special_tokens=False)[0].ids
            == backend.encode(probe, add_special_tokens=False).ids
        )
    except Exception:
        return None
    return encode if same else None


def _without_nfc(backend: Any) -> Any:
    """`encode_batch_fast` of a copy of `backend` without its normaliser, where that normaliser is
    Unicode NFC alone (Qwen's tokenizers): for a text already in NFC (`encode` asks
    `unicodedata.is_normalized`, which answers an ASCII text without reading it) normalising
    changes nothing, and every other step (added tokens, pre-tokenizer, model) is the same, so the
    ids are the same. The normaliser's pass is ~16% of tokenizing a harness's 1.7k-character tool
    output (docs/gateway.md, "Tokenizing a tool output"). None: `backend` has another normaliser."""
    normalizer = getattr(backend, "normalizer", None)
    if type(normalizer).__name__ != "NFC" or type(normalizer).__module__ != "tokenizers.normalizers":
        return None
    try:
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        copy.normalizer = None
    except Exception:
        return None
    return copy.encode_batch_fast


def _decode_concatenates(backend: Any, tokenizer: Any) -> bool:
    """Whether `ChatRenderer.decode` joins at whole characters (its attribute `decode_concatenates`):
    the backend decodes (no Python clean-up of spaces) with the byte-level decoder alone, which maps
    each id to its bytes, reads them as UTF-8 and puts an added token's text between runs of them.
    Decoders that strip a leading space or join word pieces do not."""
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        from tokenizers import decoders
    except ImportError:
        return False
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


def _fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers` object behind a fast HF tokenizer, when encoding with it gives the same ids:
    transformers' `encode` wraps it in per-call Python work that costs several times the encoding
    of a short bridge. Checked on a probe with special tokens; None: use `tokenizer.encode`."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode"):
        return None
    specials = [t for t in (getattr(tokenizer, "all_special_tokens", None) or []) if isinstance(t, str)]
    probe = f'Hello, world!\n  {"".join(specials[:4])} tail {{"k": [1, 2]}} \u00e9\u4e2d'
    try:
        same = backend.encode(probe, add_special_tokens=False).ids == tokenizer.encode(
            probe, add_special_tokens=False
        )
    except Exception:
        return None
    return backend if same else None


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    """Reasoning under every name templates read (as transformers does)."""
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        return message
    return {**message, "thinking": reasoning, "reasoning": reasoning}
