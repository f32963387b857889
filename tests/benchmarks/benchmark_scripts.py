# SPDX-License-Identifier: Apache-2.0
"""The scripts under benchmarks/ as modules, for their CPU tests (they are scripts,
not a package)."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py, imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
