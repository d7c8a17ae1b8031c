#!/bin/bash
cat > /app/greet.py <<'EOF'
def greet(name):
    return f"Hello, {name}!"
EOF
