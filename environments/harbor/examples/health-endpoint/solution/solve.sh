#!/bin/bash
echo '{"host": "127.0.0.1", "port": 8099, "health_path": "/healthz"}' > /app/config/service.json
