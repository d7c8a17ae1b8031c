"""The `run_python` tool of the code_sandbox environment and the answer extractor.

`run_python` runs the model's code in the episode's sandbox (one per episode; files persist
between calls) and returns what it printed, its exit status and how it ended (timeout, memory),
truncated to fit a prompt. Malformed calls never reach it: the tool loop
(`palaestra.environments.episode.ToolLoop`) answers them with the error.
"""

from __future__ import annotations

import re
from typing import Any

from palaestra.environments.episode import format_exec
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


async def run_python(box: Sandbox, code: str, timeout_s: float) -> tuple[str, ExecResult]:
    """Runs ``code`` (the call's checked ``code`` argument) in ``box``: the model's text and the result."""
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
