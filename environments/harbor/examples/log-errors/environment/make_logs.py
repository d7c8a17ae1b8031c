"""Writes the task's logs (deterministic): run at build time."""

import os
import random
import sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = random.Random(7)
services = ["api", "auth", "billing", "search"]
for day in range(3):
    with open(os.path.join(out, f"day{day}.log"), "w") as f:
        for i in range(200):
            level = rng.choice(["INFO", "INFO", "WARN", "ERROR"])
            f.write(
                f"2026-01-0{day + 1}T00:{i // 60:02d}:{i % 60:02d} {level} {rng.choice(services)} event {i}\n"
            )
