# SPDX-License-Identifier: Apache-2.0
"""Test configuration for the overlay's tests.

Tests import the *installed* vLLM (the overlay wheel), never vllm_overlay/.
Without a CUDA GPU, Triton kernels run under the Triton interpreter
(TRITON_INTERPRET=1, set here before anything imports Triton) and tests marked
`gpu` are skipped; on the GPU host they run.

tests/ and benchmarks/ are packages, as upstream's are: helpers import as
`tests.models.glm5_tiny` or `benchmarks.kernels.cuda_graph_timing` (pytest puts the
repository root on sys.path), and a file that runs as a script runs as
`python -m tests.…` from the repository root.
"""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    # vllm.triton_utils swaps Triton for a placeholder when Triton sees no
    # active GPU driver; the interpreter needs none, so hand it the real module.
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    import vllm.triton_utils as triton_utils

    triton_utils.HAS_TRITON = True
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def run_without_gpu():
    """Run a module of tests/ (`python -m tests.…`, from the repository root) in a
    plain process: no GPU and no Triton interpreter, which cannot compile (Triton
    compiles for any target without a GPU). Returns what the module prints as JSON
    on its last line."""
    import json
    import subprocess
    import sys

    def run(module: str, *args, timeout: int = 600):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture
def default_vllm_config():
    """A default VllmConfig for code that calls get_current_vllm_config() outside
    an engine (same fixture as upstream's tests/conftest.py)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def dist_init():
    """Single-process NCCL 'distributed' environment (as upstream's fixture)."""
    import contextlib
    import tempfile

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.vllm import get_current_vllm_config_or_none
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    fd, temp_file = tempfile.mkstemp()
    os.close(fd)
    current = get_current_vllm_config_or_none()
    ctx = contextlib.nullcontext() if current else set_current_vllm_config(VllmConfig())
    try:
        with ctx:
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{temp_file}",
                local_rank=0,
                backend="nccl",
            )
            initialize_model_parallel(1, 1)
            yield
        cleanup_dist_env_and_memory()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp_file)


@pytest.fixture
def workspace_init():
    """vLLM's workspace manager on the GPU (as upstream's fixture)."""
    from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

    if torch.cuda.is_available():
        init_workspace_manager(torch.device("cuda:0"))
    yield
    reset_workspace_manager()
