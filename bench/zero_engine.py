"""The zero-work engine's command, kept at its old path for the benchmarks: see palaestra/engine/zero.py.

python bench/zero_engine.py --port 31000 --reply-ids 1234 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from palaestra.engine.zero import main  # noqa: E402

if __name__ == "__main__":
    main()
