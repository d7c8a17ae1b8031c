#!/bin/bash
python3 - <<'EOF'
pairs = dict(l.strip().split("=", 1) for l in open("/app/deploy/app.env") if "=" in l)
assert pairs == {"SECRET_KEY": "change-me", "LOG_LEVEL": "info", "WORKERS": "4",
                 "DATABASE_URL": "sqlite:////app/data/app.db"}, pairs
EOF
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
