#!/bin/bash
python3 - <<'EOF'
import configparser
c = configparser.ConfigParser(); c.read("/app/settings.ini")
assert c["server"]["port"] == "8080" and c["server"]["host"] == "0.0.0.0" and c["logging"]["level"] == "info"
EOF
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
