"""The swe_agent's tools (OpenAI tools format) and what they do in the episode's sandbox, where the
repository is unpacked under ``repo/``. Every tool answers with text. The tool loop
(`palaestra.environments.episode.ToolLoop`) checks the tool's name and arguments before
`call_tool` runs; a path outside the repository is a `ToolCallError` here. Either way the model gets
an error text that starts with "error:" and the episode goes on.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from palaestra.environments.episode import ToolCallError, format_exec
from palaestra.environments.swe_agent.repo_env import ACTIVATE
from palaestra.sandbox.base import ExecResult, Sandbox


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool("bash", "Run a shell command in the repository's root (no network).", command="The command."),
    _tool(
        "read_file", "Read a file of the repository, with line numbers.", path="Path relative to the root."
    ),
    _tool(
        "str_replace",
        "Replace the one occurrence of old_str in a file with new_str.",
        path="Path relative to the root.",
        old_str="Text that occurs exactly once in the file.",
        new_str="The replacement.",
    ),
    _tool(
        "write_file", "Create or overwrite a file.", path="Path relative to the root.", content="The content."
    ),
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Finish: your changes to the repository are graded.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
TOOL_NAMES = {t["function"]["name"] for t in TOOLS}


def repo_path(path: str) -> str:
    """``repo/<path>`` for a path inside the repository, else `ToolCallError`."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts:
        raise ToolCallError(
            f"error: path must be relative to the repository root and stay inside it: {path!r}"
        )
    return str(PurePosixPath("repo") / pure)


async def call_tool(
    box: Sandbox, name: str, args: dict[str, Any], timeout_s: float
) -> tuple[str, ExecResult | None]:
    """Runs one call of a tool in `TOOLS` with its checked arguments (`episode.check_arguments`);
    returns the text for the model and the command's result (bash only)."""
    if name not in TOOL_NAMES:
        raise ToolCallError(f"error: unknown tool {name!r}; the tools are {', '.join(sorted(TOOL_NAMES))}")
    if name == "bash":
        result = await box.exec(f"{ACTIVATE}cd repo && {args['command']}", timeout=timeout_s)
        return format_exec(result), result
    if name == "read_file":
        path = repo_path(args["path"])
        try:
            text = (await box.download(path)).decode(errors="replace")
        except FileNotFoundError:
            return f"error: no such file: {path[5:]}", None
        lines = text.splitlines()
        shown = "\n".join(f"{i:4d}  {line}" for i, line in enumerate(lines[:400], 1))
        return shown + ("\n[... truncated]" if len(lines) > 400 else ""), None
    if name == "write_file":
        await box.upload(repo_path(args["path"]), args["content"])
        return f"wrote {args['path']}", None
    if name == "str_replace":
        path = repo_path(args["path"])
        try:
            text = (await box.download(path)).decode()
        except FileNotFoundError:
            return f"error: no such file: {args['path']}", None
        count = text.count(args["old_str"]) if args["old_str"] else 0
        if count != 1:
            return f"error: old_str occurs {count} times in {args['path']}; it must occur exactly once", None
        await box.upload(path, text.replace(args["old_str"], args["new_str"]))
        return f"edited {args['path']}", None
    return "submitted", None  # submit takes no arguments; whatever came is ignored


SNAPSHOT = (
    "import os, sys, tarfile\n"
    "with tarfile.open(sys.argv[1], 'w:gz') as tar:\n"
    "    for root, dirs, files in os.walk('repo'):\n"
    "        dirs[:] = [d for d in dirs if d not in ('.git', '__pycache__')]\n"
    "        for name in files:\n"
    "            path = os.path.join(root, name)\n"
    "            if os.path.isfile(path) and not os.path.islink(path):\n"
    "                tar.add(path, arcname=os.path.relpath(path, 'repo'))\n"
)


async def download_repo(box: Sandbox) -> bytes:
    """The agent's repository (without .git) as a .tar.gz."""
    result = await box.exec(["python3", "-c", SNAPSHOT, "_agent_repo.tgz"], timeout=60)
    if not result.ok:
        raise RuntimeError(f"could not pack the agent's repository: {result.status} {result.stderr[-300:]}")
    return await box.download("_agent_repo.tgz")


__all__ = ["TOOLS", "call_tool", "download_repo", "repo_path"]
