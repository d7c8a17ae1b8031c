#!/bin/bash
python3 - <<'EOF'
import collections, glob
counts = collections.Counter()
for path in glob.glob("/app/logs/*.log"):
    for line in open(path):
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "ERROR":
            counts[parts[2]] += 1
expected = "".join(f"{s} {n}\n" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
try:
    got = open("/app/report/errors.txt").read()
except OSError:
    got = None
ok = got is not None and got.strip().splitlines() == expected.strip().splitlines()
open("/logs/verifier/reward.txt", "w").write("1" if ok else "0")
EOF
