"""tests/vision: helpers and the NeMo oracle are imported as plain modules from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
