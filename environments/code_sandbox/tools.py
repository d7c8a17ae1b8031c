"""The `run_python` tool of the code_sandbox environment and the answer extractor.

`run_python` runs the model's code in the episode's sandbox (one per episode; files persist
between calls) and returns what it printed, its exit status and how it ended (timeout, memory),
truncated to fit a prompt. Malformed calls come back as an error text, never an exception.
"""

from __future__ import annotations

import json
import re
from typing import Any

from palaestra.sandbox.base import ExecResult, Sandbox

RUN_PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run a Python 3 program in a scratch sandbox and see its output. Files persist "
        "between calls; there is no network. Use it to test your function before you answer.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program to run."}},
            "required": ["code"],
        },
    },
}


class ToolCallError(ValueError):
    """The model's call could not be used; its message goes back to the model as the tool result."""


def parse_arguments(arguments: str, required: tuple[str, ...]) -> dict[str, Any]:
    """The call's arguments as a dict with every `required` key as a string, or `ToolCallError`."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"error: the arguments are not valid JSON ({exc.msg})") from None
    if not isinstance(args, dict):
        raise ToolCallError("error: the arguments must be a JSON object")
    for key in required:
        if not isinstance(args.get(key), str):
            raise ToolCallError(f"error: missing string argument {key!r}")
    return args


def format_exec(result: ExecResult, limit: int = 2000) -> str:
    """A process's result as the model sees it: status line, then stdout and stderr (tails)."""
    head = f"exit code {result.exit_code}" if result.status == "ok" else f"{result.status}: {result.detail}"
    parts = [head]
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            cut = text if len(text) <= limit else "...[truncated]...\n" + text[-limit:]
            parts.append(f"[{name}]\n{cut}")
    return "\n".join(parts)


async def run_python(box: Sandbox, arguments: str, timeout_s: float) -> tuple[str, ExecResult]:
    """Runs the call's ``code`` in ``box``; raises `ToolCallError` for a malformed call."""
    code = parse_arguments(arguments, ("code",))["code"]
    await box.upload("main.py", code)
    result = await box.exec(["python3", "main.py"], timeout=timeout_s)
    return format_exec(result), result


_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str | None) -> str | None:
    """The last fenced code block of the answer (an unclosed final fence counts), or None."""
    if not text:
        return None
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1]
    tail = re.search(r"```(?:python|py)?[ \t]*\n(.*)$", text, re.DOTALL)
    return tail.group(1) if tail else None
