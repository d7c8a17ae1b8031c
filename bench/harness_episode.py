"""A long coding-agent episode through the gateway, in Claude Code's request shape: per-turn gateway
cost, and the engine's prefix-cache hit rate, over the episode. One run, ratios.

    .venv/bin/python bench/harness_episode.py [--turns 40] [--output-chars 1500]

Each turn is sent as Claude Code 2.1.328 sends its turns (tests/gateway/test_controls.py has the
shape): system blocks with `cache_control`, a dozen tools, `anthropic-beta` flags,
`thinking: adaptive`, `output_config.effort`, `context_management`, `max_tokens: 32000`, a system
reminder as a `role: "system"` message; after each answer the assistant's content blocks go back
with a user `tool_result` of `--output-chars` characters (a command's output), as the harness
appends them. The engine is the embedded engine serving `tiny` (a real prefix cache); the gateway is
a subprocess, its CPU read from /proc. Printed:

* gateway CPU per turn over the last 4 turns vs the first 4 (an append renders only what is new:
  goal <= 1.2x), and the gateway's own `call_overhead_seconds` mean over the episode;
* the engine's prefix-cache hit rate over the episode (cached prompt tokens / prompt tokens, from
  each answer's `usage.cache_read_input_tokens`), and on the last turn;
* per turn, the share of the previous turn's prompt the engine found in its prefix cache (goal:
  >= 0.95 on every bridged turn), and the lowest;
* the wall time of turn 1 and of the last turn (a fixed number of sampled tokens each: what grows
  is the prefill of the uncached part, i.e. the time to the first token);
* that every turn bridged (no fork) and what was recorded as ignored controls.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway import cpu_seconds  # noqa: E402
from palaestra.engine.cli import engine_process  # noqa: E402
from palaestra.gateway.cli import gateway_process  # noqa: E402

KEY = {"Authorization": "Bearer bench"}
ENV = {"PALAESTRA_API_KEY": "bench", "PALAESTRA_ADMIN_KEY": "bench-admin"}
BETAS = "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,effort-2025-11-24"


def tools() -> list[dict]:
    names = [
        "Bash",
        "Edit",
        "Read",
        "Write",
        "Grep",
        "Glob",
        "Agent",
        "Skill",
        "WebFetch",
        "Todo",
        "Task",
        "Ls",
    ]
    schema = {
        "type": "object",
        "properties": {"command": {"type": "string"}, "path": {"type": "string"}},
        "required": ["command"],
    }
    return [{"name": n, "description": f"The {n} tool. " * 12, "input_schema": schema} for n in names]


def body(messages: list[dict]) -> dict:
    return {
        "model": "tiny",
        "system": [
            {"type": "text", "text": "x-billing-header: bench"},
            {"type": "text", "text": "You are a coding agent. " * 40, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "tools": tools(),
        "metadata": {"user_id": "bench"},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--output-chars", type=int, default=1500, help="characters of each tool output")
    ap.add_argument("--max-new", type=int, default=16, help="tokens the engine samples per turn")
    args = ap.parse_args()
    spool = Path("runs/bench-harness-spool") / str(time.time())
    with (
        engine_process("tiny", extra_args=["--num-threads", "1"]) as engine,
        gateway_process("tiny", engine.url, str(spool), env=ENV) as gw,
        httpx.Client(timeout=300, trust_env=False) as c,
    ):
        s = c.post(f"{gw.url}/sessions", json={"env": "bench-harness"}, headers=KEY).json()
        url = f"{s['base_url']}/messages?beta=true"
        headers = {"x-api-key": s["api_key"], "anthropic-beta": BETAS}
        messages: list[dict] = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Fix the failing test in this repository."}],
            },
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /work"}]},
        ]
        cpu, prompt, cached, wall = [], [], [], []
        for turn in range(args.turns):
            b = body(messages)
            b["max_tokens"] = args.max_new  # a fixed sampled length, so turns compare (a random model
            # given Claude Code's 32000, clamped to the context, would sample thousands of tokens)
            t0, w0 = cpu_seconds(gw.pid), time.perf_counter()
            r = c.post(url, json=b, headers=headers)
            wall.append(time.perf_counter() - w0)
            cpu.append(cpu_seconds(gw.pid) - t0)
            if r.status_code != 200:
                raise SystemExit(f"turn {turn + 1}: {r.status_code} {r.text}")
            answer = r.json()
            usage = answer["usage"]
            prompt.append(usage["input_tokens"])
            cached.append(usage.get("cache_read_input_tokens") or 0)
            messages.append({"role": "assistant", "content": answer["content"]})
            line = f"line {turn}: " + "x" * 60 + "\n"
            output = (line * (args.output_chars // len(line) + 1))[: args.output_chars]
            messages.append({"role": "user", "content": [{"type": "text", "text": output}]})
        metrics = c.get(f"{gw.url}/metrics", headers=KEY).text
        traj = c.get(f"{gw.url}/sessions/{s['session_id']}", headers=KEY).json()
    first, last = sum(cpu[:4]) / 4, sum(cpu[-4:]) / 4
    over_sum = metric(metrics, "palaestra_gateway_call_overhead_seconds_sum")
    over_n = metric(metrics, "palaestra_gateway_call_overhead_seconds_count")
    print(
        f"{args.turns} turns, prompt {prompt[0]} -> {prompt[-1]} tokens: gateway CPU per turn "
        f"{first * 1e3:.1f} ms (turns 1-4) -> {last * 1e3:.1f} ms (last 4) = {last / first:.2f}x; "
        f"gateway overhead per call {over_sum / max(over_n, 1) * 1e3:.1f} ms (mean of {int(over_n)})"
    )
    print(
        f"engine prefix-cache hit rate: {sum(cached) / sum(prompt):.3f} over the episode, "
        f"{cached[-1] / prompt[-1]:.3f} on the last turn"
    )
    # each turn's reuse of what the previous turn sent: cached tokens / the previous prompt's tokens
    reuse = [cached[t] / prompt[t - 1] for t in range(1, len(prompt))]
    print("prefix reuse per turn (cached / previous prompt): " + " ".join(f"{r:.2f}" for r in reuse))
    worst = min(range(len(reuse)), key=reuse.__getitem__) if reuse else 0
    if reuse:
        print(
            f"lowest reuse {reuse[worst]:.3f} at turn {worst + 2} (goal >= 0.95 on every bridged turn: "
            f"{'met' if reuse[worst] >= 0.95 else 'NOT met'})"
        )
    print(
        f"turn latency ({args.max_new} sampled tokens; the prefill of what is not cached is what grows): "
        f"turn 1 {wall[0] * 1e3:.0f} ms, turn {len(wall)} {wall[-1] * 1e3:.0f} ms = {wall[-1] / wall[0]:.2f}x "
        f"(prompt {prompt[-1] / prompt[0]:.1f}x longer)"
    )
    reasons = Counter(f.get("reason") for f in traj["forks"])
    print(
        f"forks: {len(traj['forks'])} {dict(reasons)}; ignored controls (calls): {traj['ignored_controls']}"
    )


if __name__ == "__main__":
    main()
