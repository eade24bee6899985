"""Makes `e2e_helpers` importable by the e2e tests (tests/ is not a package)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
