#!/bin/bash
cat > /app/summarize.py <<'EOF'
import csv
import json
from collections import defaultdict

totals = defaultdict(float)
with open("/app/data/sales.csv") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] += float(row["amount"])
with open("/app/out/summary.json", "w") as f:
    json.dump({k: totals[k] for k in sorted(totals)}, f)
EOF
python3 /app/summarize.py
