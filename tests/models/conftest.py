# SPDX-License-Identifier: Apache-2.0
"""Model-test helpers (tiny GLM-5 checkpoint, generation script) import as top-level
modules from tests/models, also for the tests in its subfolders."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
