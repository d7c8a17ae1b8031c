#!/bin/bash
python3 - <<'EOF'
p = "/app/CHANGELOG.md"
text = open(p).read()
open(p, "w").write(text.replace("## 1.0.0", "## 1.1.0\n\n- Added the --dry-run flag.\n\n## 1.0.0", 1))
EOF
