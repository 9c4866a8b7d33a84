"""The tensor-parallel tests reuse the engine tests' conversations (tests/engine/engine_cases.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
