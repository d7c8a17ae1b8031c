"""Which of TextArena's registered games can be played on this machine, and with how many players.

    .venv/bin/python -m bench.textarena_games [--list]

Probes every registered id (without its ``-raw``/``-train`` variants) the way the environment does
when a run's config is checked (`environments/textarena/games.probe`: made with no download
allowed, reset with the fewest players it accepts) and prints the counts: playable single-player,
playable multi-player, and the ones that cannot be played grouped by why (NLTK data it would
download, an API key, an error at reset, ...). `--list` prints every id with its outcome.
"""

from __future__ import annotations

import collections
import re
import time

from bench import common
from palaestra.environments.textarena.games import GameUnavailable, game_ids, probe


def why(message: str) -> str:
    """A short class for a GameUnavailable message."""
    if "NLTK data" in message:  # "... needs the NLTK data 'words', 'x', which it would download ..."
        listed = message.split("needs the NLTK data", 1)[1].split("which", 1)[0]
        return "needs NLTK data: " + ", ".join(sorted(set(re.findall(r"'([a-z_]+)'", listed))))
    if re.search(r"api[_ ]?key|OPENAI|OPENROUTER|ANTHROPIC", message, re.I):
        return "needs an API key"
    if "SyntaxError" in message:
        return "its module needs a newer Python (SyntaxError on 3.11)"
    if "No such file or directory" in message or "directory not found" in message:
        return "a data file the wheel does not ship"
    if "No module named" in message or "not found in registry" in message:
        return "registered without its module"
    if "could not be reset" in message:
        return "raises at reset with 1-6 players"
    m = re.search(r"cannot be made here: (\w+)", message)
    return f"cannot be made: {m.group(1)}" if m else message[:80]


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--list", action="store_true", help="print every id with its outcome")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ids = game_ids()
    outcome: dict[str, str] = {}
    for gid in ids:
        try:
            n = probe(gid)
            outcome[gid] = "playable, 1 player" if n == 1 else f"playable, {n} players"
        except GameUnavailable as exc:
            outcome[gid] = "not playable: " + why(str(exc))
        except Exception as exc:  # a probe that fails outside the game: reported, not hidden
            outcome[gid] = f"not playable: probe failed: {type(exc).__name__}"
    if args.list:
        for gid in ids:
            print(f"{gid:40s} {outcome[gid]}")
    counts = collections.Counter(outcome.values())
    playable = sum(v for k, v in counts.items() if k.startswith("playable"))
    print(
        f"{len(ids)} registered game ids probed in {time.perf_counter() - t0:.0f} s: {playable} playable here"
    )
    for label, n in sorted(counts.items(), key=lambda kv: (not kv[0].startswith("playable"), -kv[1])):
        print(f"  {n:4d}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
