#!/bin/bash
python3 - <<'EOF'
import json, os
best = {}
for line in open(os.environ["DATA_DIR"] + "/events.jsonl"):
    r = json.loads(line)
    if r["id"] not in best or r["version"] > best[r["id"]]["version"]:
        best[r["id"]] = r
with open("/app/data/clean.jsonl", "w") as f:
    for k in sorted(best):
        f.write(json.dumps(best[k]) + "\n")
EOF
