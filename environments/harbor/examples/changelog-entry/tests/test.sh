#!/bin/bash
python3 - <<'EOF'
text = open("/app/CHANGELOG.md").read()
new, old = text.index("## 1.1.0"), text.index("## 1.0.0")
assert new < old and "- Added the --dry-run flag." in text[new:old] and "- First release." in text[old:]
EOF
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
