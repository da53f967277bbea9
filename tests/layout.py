"""Where things are, for tests in any folder under tests/: the repository and the shared test
material (helper scripts, worker scripts).
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
