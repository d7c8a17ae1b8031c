"""What a chat template's rendering costs the gateway, with jinja's sandbox answering every attribute
read and call, and with the renderer's shortcuts (`renderer._attribute_checks_memoised`): ratios in
one process, alternating, and the texts compared.

    .venv/bin/python -m bench.template_render [--model tiny-qwen3] [--turns 20] [--rounds 3]

The conversation is a Codex-shaped tool loop (a 7 KB system prompt, 8 tools of ~1 KB, `--turns`
assistant turns each with reasoning and a shell call, each answered by 1.5 KB of this repository's
code). Printed per round: a bridged turn's two whole renderings (`bridge._bridge_full`: the request,
and the request with the sentinel in the last reply: what a turn with reasoning in its history
renders) and a short bridge's (a system message and three messages, no tools), in CPU ms, each
with its ratio. The shortcuts are switched off by removing them from the template's environment,
which falls back to the sandbox's own methods.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench import common
from palaestra.gateway.bridge import SENTINEL
from palaestra.gateway.renderer import ChatRenderer
from palaestra.models import resolve_model

CODE = (Path(__file__).resolve().parents[1] / "gateway" / "bridge.py").read_text() * 4


def conversation(turns: int) -> tuple[list[dict], list[dict]]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool{i}",
                "description": "d" * 400,
                "parameters": {
                    "type": "object",
                    "properties": {f"p{j}": {"type": "string", "description": "x" * 60} for j in range(6)},
                },
            },
        }
        for i in range(8)
    ]
    messages = [
        {"role": "system", "content": "S" * 7000},
        {"role": "user", "content": "Read the repository."},
    ]
    for k in range(turns):
        call = {
            "id": f"c{k}",
            "type": "function",
            "function": {"name": "exec_command", "arguments": {"cmd": "cat"}},
        }
        reasoning = f"Step {k}: the next part of the code is read with the shell tool. " * 10
        messages.append(
            {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]}
        )
        messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": CODE[k * 1500 : (k + 1) * 1500]})
    return messages, tools


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", default="tiny-qwen3", help="a preset whose chat template is rendered")
    ap.add_argument("--turns", type=int, default=20, help="tool turns in the history")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for name in ("turns", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be 1 or more; got {getattr(args, name)}")
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(resolve_model(args.model)))
    if renderer._compiled is None:
        raise SystemExit(
            f"{args.model}: no compiled template (transformers' public path): nothing to compare"
        )
    env = renderer._compiled.environment
    shortcuts = {name: env.__dict__[name] for name in ("getattr", "call") if name in env.__dict__}
    if not shortcuts:
        raise SystemExit(
            f"{args.model}: its template's environment is not jinja's immutable sandbox: no shortcuts"
        )
    messages, tools = conversation(args.turns)
    extra = {"enable_thinking": True}
    k = len(messages) - 2
    with_sentinel = [*messages[:k], {**messages[k], "content": SENTINEL}, messages[-1]]
    short = [messages[0], *messages[-3:]]
    full_text = renderer.render(messages, tools, True, extra)
    print(
        f"{args.model}: {len(messages)} messages, {len(renderer.encode(full_text)):,} tokens rendered whole"
    )

    def timed(on: bool, n_full: int = 20, n_short: int = 300) -> tuple[float, float, tuple[str, ...]]:
        for name, fn in shortcuts.items():
            if on:
                setattr(env, name, fn)
            elif name in env.__dict__:
                delattr(env, name)
        start = time.process_time()
        for _ in range(n_full):
            texts = (
                renderer.render(messages, tools, True, extra),
                renderer.render(with_sentinel, tools, True, extra),
            )
        full = (time.process_time() - start) / n_full
        start = time.process_time()
        for _ in range(n_short):
            texts += (renderer.render(short, None, True, extra),)
        return full, (time.process_time() - start) / n_short, texts[:3]

    for rnd in range(1, args.rounds + 1):
        full_off, short_off, texts_off = timed(False)
        full_on, short_on, texts_on = timed(True)
        same = "same text" if texts_off == texts_on else "TEXT DIFFERS"
        print(
            f"round {rnd}: a bridged turn's two whole renderings {full_off * 1e3:.2f} -> {full_on * 1e3:.2f} ms "
            f"({full_on / full_off:.2f}x); a short bridge's rendering {short_off * 1e3:.3f} -> "
            f"{short_on * 1e3:.3f} ms ({short_on / short_off:.2f}x); {same}"
        )


if __name__ == "__main__":
    main()
