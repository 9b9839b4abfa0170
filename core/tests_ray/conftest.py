"""``lmdock serve --replicas 2`` on a local Ray cluster: the real server helpers of ``core/tests_serve``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests_serve"))
