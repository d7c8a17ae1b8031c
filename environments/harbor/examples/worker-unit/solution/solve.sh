#!/bin/bash
cat > /app/units/worker.service <<'EOF'
[Unit]
Description=Queue worker
After=network.target

[Service]
ExecStart=/usr/bin/python3 /app/worker.py
Restart=on-failure
User=worker

[Install]
WantedBy=multi-user.target
EOF
