"""Episodes per second of the library families (reasoning-gym, TextArena single-player and self-play)
at concurrency 1 and 16, one run, through the real gateway.

    .venv/bin/python -m bench.families [--episodes 32]

The model is a scripted engine (a TEST DOUBLE from tests/support/servers.py answering /generate
with a correct agent's token ids: the dataset's reference answer; GuessTheNumber's secret; the
middle row for TicTacToe's first seat), so the figures are what the environments, the gateway and
the SDK runner cost per episode, without model compute.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import time

from transformers import AutoTokenizer

from bench import common
from palaestra.environments.reasoning_gym.env import ReasoningGymEnv
from palaestra.environments.textarena.env import TextArenaEnv, TextArenaTask
from palaestra.environments.textarena.games import Game
from palaestra.models import resolve_model
from palaestra.sdk import GatewayClient, run_rollouts
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server


def families(n: int):
    """(name, env, tasks, reply(prompt) -> text) per family."""
    rg = ReasoningGymEnv(["spell_backward", "chain_sum", "number_sorting"], size=max(n, 8))
    rg_tasks = list(itertools.islice(rg.tasks(0), n))
    answers = {t.question: t.entry["answer"] for t in rg_tasks}

    def rg_reply(prompt: str) -> str:
        return "<answer>" + next(a for q, a in answers.items() if q in prompt) + "</answer>"

    guess = TextArenaEnv(["GuessTheNumber-v0"])
    # one seed for every episode: the agent knows the secret (each episode is its own game)
    seed = next(iter(guess.tasks(0))).seed
    secret = Game("GuessTheNumber-v0", 1, seed).state.game_state["game_number"]
    guess_tasks = [
        TextArenaTask(f"g{i}", "GuessTheNumber-v0", "GuessTheNumber-v0", seed, 1) for i in range(n)
    ]

    ttt = TextArenaEnv(["TicTacToe-v0"])
    ttt_tasks = [TextArenaTask(f"t{i}", "TicTacToe-v0", "TicTacToe-v0", 5, 2) for i in range(n)]

    def ttt_reply(prompt: str) -> str:  # seat 0 takes 4, 3, 5; seat 1 takes 0, 1
        mine = prompt.count("<|im_start|>assistant") - 1
        seat1 = "[Player 0]" in prompt.split("<|im_start|>user", 2)[1]
        return (["[0]", "[1]", "[2]"] if seat1 else ["[4]", "[3]", "[5]"])[mine]

    return [
        ("reasoning-gym (1 turn)", rg, rg_tasks, rg_reply),
        ("textarena GuessTheNumber (1 turn)", guess, guess_tasks, lambda p: f"[{secret}]"),
        ("textarena TicTacToe self-play (2 seats, 5 turns)", ttt, ttt_tasks, ttt_reply),
    ]


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--episodes", type=int, default=32, help="episodes per family and concurrency")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for name, env, tasks, reply in families(args.episodes):
        engine = ScriptedEngine(
            lambda ids, i, reply=reply: tok.encode(reply(tok.decode(ids)), add_special_tokens=False) + [end],
            stop_ids={end},
        )
        rates = []
        with tempfile.TemporaryDirectory() as spool, ThreadServer(engine.app()) as eng:
            with gateway_server(eng.url, spool, tok, api_key="k") as gw:
                for concurrency in (1, 16):

                    async def run(env=env, tasks=tasks, concurrency=concurrency):
                        client = GatewayClient(gw.url, "k")
                        try:
                            return await run_rollouts(
                                env, client, tasks, concurrency=concurrency, progress=False
                            )
                        finally:
                            await client.close()

                    t0 = time.perf_counter()
                    summary = asyncio.run(run())
                    wall = time.perf_counter() - t0
                    assert set(summary.statuses) == {"completed"}, summary.statuses
                    rates.append(len(tasks) / wall)
                    rewards = sorted(set(summary.rewards))
        rows.append((name, *rates, rewards))
    print(f"{'family':52} {'episodes/s at 1':>16} {'at 16':>8} {'ratio':>6}  rewards")
    for name, one, sixteen, rewards in rows:
        print(f"{name:52} {one:16.2f} {sixteen:8.2f} {sixteen / one:5.1f}x  {rewards}")


if __name__ == "__main__":
    main()
