# SPDX-License-Identifier: Apache-2.0
"""Put this folder first on a server's PYTHONPATH: each Python process of it then prints
the stacks of all its threads to stderr on SIGUSR2 (faulthandler) and goes on running.
benchmarks/serve_soak.py --stall-signal SIGUSR2 sends it at each stall. A sitecustomize
that this one shadows (later on sys.path) is still run."""

import faulthandler
import importlib.machinery
import importlib.util
import os
import signal
import sys

faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_shadowed()
