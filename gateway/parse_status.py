"""A turn's parse status: how its output text was split into content, reasoning and tool calls.

`describe` is recorded on every chat turn (`GET /sessions/{id}`, turn `parse`): the number of calls
parsed, whether reasoning was split off (`split`, `none`, or `off` without a reasoning parser), and
each failure with its reason (`parsers.PARSE_ERROR_REASONS`), the parser's message and the failed
tool-call block's token span `[start, end)` in the turn's output ids. Failures never fail a call:
the text stays in the content the agent receives (docs/gateway.md, "Parse status").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from palaestra.gateway import parsers


def describe(
    ids: list[int],
    text: str,
    parsed: parsers.ParsedOutput,
    tool_parser: parsers.ToolCallParser | None,
    reasoning_parser: parsers.ReasoningParser | None,
    decode: Callable[[list[int]], str],
) -> dict[str, Any]:
    """The parse status of one output (`tool_parser` None: tools were off for the call)."""
    errors = []
    if parsed.parse_errors:
        blocks = failed_blocks(text, parsed.content or "", tool_parser) if tool_parser else []
        for message in parsed.parse_errors:
            reason = parsers.error_reason(message)
            span = blocks.pop(0) if blocks and reason != "unknown_tool" else None
            tokens = [token_at(ids, span[0], decode), token_at(ids, span[1], decode)] if span else None
            errors.append({"reason": reason, "error": message, "span": tokens})
    if reasoning_parser is None:
        reasoning = "off"
    else:
        reasoning = "split" if parsed.reasoning_content is not None else "none"
    return {"tool_calls": len(parsed.tool_calls), "reasoning": reasoning, "errors": errors}


def failed_blocks(text: str, content: str, tool_parser: parsers.ToolCallParser) -> list[tuple[int, int]]:
    """Character spans of tool-call blocks of `text` that stayed in the content (did not parse)."""
    start_marker = tool_parser.start_marker
    end_marker = getattr(tool_parser, "end_marker", "")
    spans, at = [], text.find(start_marker) if start_marker else -1
    while at >= 0:
        end = text.find(end_marker, at) if end_marker else -1
        end = len(text) if end < 0 else end + len(end_marker)
        if text[at:end] in content:
            spans.append((at, end))
        at = text.find(start_marker, end)
    return spans


def token_at(ids: list[int], char: int, decode: Callable[[list[int]], str]) -> int:
    """The index of the token whose text covers character `char` of the decoded ids (bisection over
    decoded prefixes: only failed parses pay for it)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[: mid + 1])) <= char:
            lo = mid + 1
        else:
            hi = mid
    return lo
