"""What the gateway's input guards cost per call, as ratios to the JSON parse they follow (one run).

    .venv/bin/python -m bench.input_guards [--repeat 2000]

For a short first-turn body and a 64-turn tool conversation (the bodies bench/gateway.py's agents
send), it times, interleaved:
* `orjson.loads` alone (what the gateway did before the guards);
* `guards.read_json` (parse + UTF-8/depth/object checks; the depth check writes the body out with
  orjson, which refuses to write more than `MAX_JSON_DEPTH` levels);
* a Python walk over every container, the depth check the guard does not use, for comparison.
Prints each path's median per call as a ratio to the parse alone.
"""

from __future__ import annotations

import json
import statistics
import time

import orjson
from prometheus_client import CollectorRegistry, Counter

from bench import common
from palaestra.gateway.guards import MAX_JSON_DEPTH, read_json

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def bodies() -> dict[str, bytes]:
    first = [{"role": "system", "content": "You are a calculator agent."}, {"role": "user", "content": "Add"}]
    long = list(first)
    for t in range(64):
        call = {"id": f"call_{t}", "type": "function"}
        call["function"] = {"name": "calculator", "arguments": json.dumps({"expression": f"{t}+1"})}
        long += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{t}", "content": str(t + 1)},
        ]
    return {
        "turn 1": orjson.dumps({"model": "m", "messages": first, "tools": [TOOL]}),
        "turn 64 (tools)": orjson.dumps({"model": "m", "messages": long, "tools": [TOOL]}),
    }


def walk_depth(value: object) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--repeat", type=int, default=2000, help="calls of each path per body")
    args = ap.parse_args()
    rejected = Counter("rejected", "unused", ["reason"], registry=CollectorRegistry())
    paths = {
        "orjson.loads": lambda raw: orjson.loads(raw),
        "read_json": lambda raw: read_json(raw, rejected),
        "loads + Python walk": lambda raw: walk_depth(orjson.loads(raw)),
    }
    print(f"MAX_JSON_DEPTH = {MAX_JSON_DEPTH}")
    for name, raw in bodies().items():
        brackets = raw.count(b"[") + raw.count(b"{")
        times: dict[str, list[float]] = {p: [] for p in paths}
        order = list(paths)
        for i in range(args.repeat):  # interleaved, in a rotating order, so noise hits every path alike
            for path in order[i % len(order) :] + order[: i % len(order)]:
                fn = paths[path]
                t0 = time.perf_counter()
                fn(raw)
                times[path].append(time.perf_counter() - t0)
        median = {p: statistics.median(t) for p, t in times.items()}
        base = median["orjson.loads"]
        ratios = ", ".join(f"{p} {median[p] / base:.2f}x" for p in paths)
        print(f"{name}: {len(raw)} bytes, {brackets} brackets: {ratios}")


if __name__ == "__main__":
    main()
