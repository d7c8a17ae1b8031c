#!/bin/bash
python3 - <<'EOF'
import json
expected = {1: "a2", 2: "b1", 3: "c3", 4: "d1"}
try:
    rows = [json.loads(l) for l in open("/app/data/clean.jsonl") if l.strip()]
except (OSError, ValueError):
    rows = []
ids = [r.get("id") for r in rows if isinstance(r, dict)]
right = sum(1 for r in rows if isinstance(r, dict) and expected.get(r.get("id")) == r.get("value"))
score = right / len(expected) if ids == sorted(ids) and len(ids) == len(set(ids)) else 0.0
open("/logs/verifier/reward.txt", "w").write(str(score))
EOF
