#!/bin/bash
cd /app
     rm -f out/summary.json
     python3 summarize.py > /dev/null 2>&1
     python3 - <<'EOF'
import json, os
expected = {"east": 7, "north": 15, "south": 5}
exists = os.path.exists("/app/out/summary.json")
try:
    got = json.load(open("/app/out/summary.json")) if exists else None
except ValueError:
    got = None
correct = isinstance(got, dict) and got == expected
ordered = correct and list(got) == sorted(got)
json.dump({"reward": float(correct and ordered), "file_written": float(exists),
           "totals_correct": float(correct), "sorted": float(ordered)},
          open("/logs/verifier/reward.json", "w"))
EOF
