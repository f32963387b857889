# SPDX-License-Identifier: Apache-2.0
"""vllm-gguf-plugin's own tests, from its pinned sdist (`build.py sdist
vllm-gguf-plugin`), against the installed overlay plugin: registration, the config
parser, the engine-args and speculator-probe patches, the GGUF linear and embedding
loaders, and gguf_utils. They run in a subprocess, as the plugin's CI would.

Not run here: test_kernels.py, test_gguf_generation.py and test_multimodal_gguf.py
download models from the Hugging Face hub and run CUDA kernels; test_gguf_download.py
mocks `glob.glob` inside `download_gguf`, which the overlay replaces (it picks a quant's
files, split parts included, by exact name from the repo listing or the cache;
tests/models/quantization/test_gguf_engine_args.py tests it). test_gguf_utils.py mocks
gguf-py's `GGUFReader` inside gguf_utils, which opens files through the overlay's
checked reader (`open_gguf`): the mock takes that name instead.
"""

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUN = ("test_plugin.py", "test_gguf_utils.py")


def test_plugin_sdist_cpu_tests(tmp_path):
    sdist = Path(subprocess.run(
        [sys.executable, str(ROOT / "build.py"), "sdist", "vllm-gguf-plugin", "-q"],
        capture_output=True, text=True, check=True).stdout.strip())
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if "/tests/" in m.name],
                       filter="data")
    tests = next(tmp_path.glob("*/tests"))
    utils = tests / "test_gguf_utils.py"
    utils.write_text(utils.read_text().replace("vllm_gguf_plugin.gguf_utils.gguf.GGUFReader",
                                               "vllm_gguf_plugin.gguf_utils.open_gguf"))
    # the tests import the installed plugin, never a copy next to them
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
         *(str(tests / t) for t in RUN)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    summary = res.stdout.strip().splitlines()[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|skipped)", summary)}
    assert res.returncode == 0 and counts.get("failed", 0) == 0, res.stdout[-4000:]
    assert counts["passed"] >= 38, summary
