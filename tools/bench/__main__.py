"""python -m tools.bench (from the repository root): see tools/bench/__init__.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's npqwen and tools

from tools.bench.main import main  # noqa: E402

sys.exit(main())
