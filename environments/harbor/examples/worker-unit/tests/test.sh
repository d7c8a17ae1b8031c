#!/bin/bash
python3 - <<'EOF'
import configparser
c = configparser.ConfigParser(strict=False, interpolation=None)
c.optionxform = str
c.read("/app/units/worker.service")
assert c["Unit"]["After"].split() == ["network.target"]
assert c["Service"]["ExecStart"] == "/usr/bin/python3 /app/worker.py"
assert c["Service"]["Restart"] == "on-failure" and c["Service"]["User"] == "worker"
assert c["Install"]["WantedBy"] == "multi-user.target"
EOF
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
