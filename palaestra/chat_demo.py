"""`make chat-demo`: two embedded engines behind the real sglang-router, and a short multi-turn chat.

    .venv/bin/python -m palaestra.chat_demo [--model smollm2-135m] [--turns 3]

Shows the inference side end to end: the chat is rendered to token ids with the model's own chat
template, every turn is sent as `input_ids` to the router with the session's `X-SMG-Routing-Key`,
the next turn's prompt is the previous prompt + the exact sampled ids + the new user message
(token-in, token-out), and the engine that holds the session reports prefix-cache hits. Prints
tokens/s per turn and a batched-throughput line. The inference side only; `make demo` trains.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import time

import httpx

QUESTIONS = [
    "What is the capital of France?",
    "And what river runs through it?",
    "Name one famous museum there.",
    "Thanks! Say goodbye in one short sentence.",
]


def _bridge_ids(
    tokenizer, messages: list[dict], prev_messages: list[dict], answer: str, last_output_text: str
) -> list[int]:
    """Tokens to append after the previous turn's sampled ids so the prompt matches the template.

    The template closes the assistant turn after its content (ChatML: `<|im_end|>` then a newline)
    and then renders the new messages. If the model already sampled the closing token, only the
    rest is added. (The gateway does this generally, with fork detection; this is the demo's
    short version for a plain chat.)
    """
    before = tokenizer.apply_chat_template(prev_messages, tokenize=False, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not full.startswith(before) or answer not in before:
        raise RuntimeError("the chat template is not append-only for this conversation")
    closing = before[before.rfind(answer) + len(answer) :]
    if last_output_text and closing.startswith(last_output_text):
        closing = closing[len(last_output_text) :]
    return tokenizer.encode(closing + full[len(before) :], add_special_tokens=False)


def chat(router_url: str, tokenizer, turns: int, session: str, max_new_tokens: int) -> None:
    messages: list[dict] = [{"role": "system", "content": "You are a concise, helpful assistant."}]
    ids: list[int] = []
    last_answer, last_stop_text = "", ""
    with httpx.Client(timeout=300, trust_env=False) as c:
        for turn, question in enumerate(QUESTIONS[:turns], start=1):
            prev = list(messages)
            messages.append({"role": "user", "content": question})
            if not ids:
                ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
                if hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                ids = list(ids)
            else:
                # token-in/token-out: keep the exact sampled ids, append only the new message's tokens
                ids = ids + _bridge_ids(tokenizer, messages, prev, last_answer, last_stop_text)
            t0 = time.perf_counter()
            r = c.post(
                f"{router_url}/generate",
                headers={"X-SMG-Routing-Key": session},
                json={
                    "input_ids": ids,
                    "return_logprob": True,
                    "sampling_params": {
                        "max_new_tokens": max_new_tokens,
                        "temperature": 0.2,
                        "top_p": 0.9,
                        "sampling_seed": turn,
                    },
                },
            )
            r.raise_for_status()
            out = r.json()
            dt = time.perf_counter() - t0
            meta = out["meta_info"]
            answer = tokenizer.decode(out["output_ids"], skip_special_tokens=True).strip()
            print(f"\n[turn {turn}] user: {question}\n[turn {turn}] assistant: {answer}")
            print(
                f"  {meta['completion_tokens']} tokens in {dt:.2f} s = {meta['completion_tokens'] / dt:.1f} tok/s; "
                f"prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from the prefix cache; "
                f"finish {meta['finish_reason']['type']}"
            )
            ids = ids + out["output_ids"]
            messages.append({"role": "assistant", "content": answer})
            last_answer = answer
            stopped = meta["finish_reason"]["type"] == "stop" and isinstance(
                meta["finish_reason"].get("matched"), int
            )
            last_stop_text = tokenizer.decode(out["output_ids"][-1:]) if stopped else ""


def batched(router_url: str, sessions: int, tokens: int) -> None:
    def one(i: int) -> int:
        with httpx.Client(timeout=300, trust_env=False) as c:
            r = c.post(
                f"{router_url}/generate",
                headers={"X-SMG-Routing-Key": f"batch-{i}"},
                json={
                    "text": f"Count to ten, attempt {i}:",
                    "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
                },
            )
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(sessions) as pool:
        total = sum(pool.map(one, range(sessions)))
    dt = time.perf_counter() - t0
    print(
        f"\n{sessions} concurrent sessions over 2 engines: {total} tokens in {dt:.2f} s = {total / dt:.1f} tok/s"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m palaestra.chat_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m", help="preset or HF directory (default: %(default)s)")
    ap.add_argument("--turns", type=int, default=3, help="chat turns (default: %(default)s, at most 4)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens per answer (default: %(default)s)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from palaestra.engine.cli import engine_process
    from palaestra.engine.router import RouterProcess
    from palaestra.models import resolve_model

    t0 = time.perf_counter()
    print(f"preparing model {args.model!r} (built once, then cached) ...", flush=True)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"  ready in {time.perf_counter() - t0:.1f} s: {model_dir}")
    print(
        "starting 2 embedded engines and the sglang-router (consistent hashing) on 127.0.0.1 ...", flush=True
    )
    with (
        engine_process(str(model_dir)) as e1,
        engine_process(str(model_dir)) as e2,
        RouterProcess([e1.url, e2.url]) as router,
    ):
        print(f"  engines {e1.url} {e2.url}; router {router.url}")
        chat(router.url, tokenizer, min(args.turns, len(QUESTIONS)), "demo-session", args.max_new_tokens)
        batched(router.url, sessions=8, tokens=32)
    print("\nnext: `make test`, or see docs/engine.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
