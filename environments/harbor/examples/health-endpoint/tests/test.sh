#!/bin/bash
cd /app
     python3 server.py > /logs/verifier/server.log 2>&1 &
     server=$!
     python3 - <<'EOF'
import time, urllib.request
ok = False
for _ in range(50):
    try:
        ok = urllib.request.urlopen("http://127.0.0.1:8099/healthz", timeout=1).read() == b"ok"
        break
    except OSError:
        time.sleep(0.1)
open("/logs/verifier/reward.txt", "w").write("1" if ok else "0")
EOF
     kill $server 2>/dev/null
