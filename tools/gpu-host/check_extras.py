# SPDX-License-Identifier: Apache-2.0
"""Do the H200 host's packages plus the bundle's extras import what a run needs?

    python tools/gpu-host/check_extras.py SITE_PACKAGES [--module M ...] [--also NAME ...]
                                          [--hide NAME ...]

SITE_PACKAGES is a full vLLM install (e.g. the CI venv's). The script builds a view of
it holding only the distributions in h200-pip-freeze.txt and h200-runtime-extras.txt
(plus vllm, vllm-gguf-plugin and any --also, less any --hide), imports each module in a
fresh `python -S` on that view, and prints OK or the import error of each. Default
modules: what the offline `vllm.LLM(...)` path of our sparse-MLA runs, the GGUF plugin
and `vllm serve` import, and "serve-app": the `vllm serve` app built for a generate model.
A directory that hidden and kept distributions share (nvidia/, cuda/, google/) is rebuilt
from the kept ones' files only. The view holds the versions installed in SITE_PACKAGES,
not the host's (host packages at other versions: see h200-runtime-extras.txt). Run on a
CPU machine, so modules that need a GPU to import (vllm.vllm_flash_attn, the MLA prefill
backends) are not among the defaults. Exit status: the number of failed imports.
--also keeps distributions the host lacks, --hide drops distributions (is one needed?).
"""

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# run as a script (tools/gpu-host is no package): `tools.common` from the repo root
sys.path.insert(0, str(HERE.parents[1]))
from tools.common import normalized_name  # noqa: E402

SERVE = ["vllm.entrypoints.cli.main", "vllm.entrypoints.cli.launch",
         "vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.serve", "serve-app"]
LLM = ["vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
       "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker",
       "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.warmup.kernel_warmup",
       "vllm.model_executor.models.deepseek_v2", "vllm.v1.attention.ops.flashmla",
       "vllm.v1.attention.backends.mla.flashmla_sparse",
       "vllm.v1.attention.backends.mla.triton_mla_sparse",
       "vllm.v1.attention.backends.mla.indexer", "vllm.model_executor.layers.sparse_attn_indexer",
       "vllm.third_party.deep_gemm", "vllm.model_executor.layers.fused_moe.fused_moe",
       "vllm.model_executor.layers.fused_moe.experts.triton_moe", "vllm.v1.sample.sampler",
       "vllm.v1.structured_output", "vllm_gguf_plugin", "vllm_gguf_plugin.plugin",
       "vllm_gguf_plugin.loader", "vllm_gguf_plugin.weights_adapter.glm_dsa",
       # get_quantization_config() imports every method's module for any quantization,
       # gguf included (auto_awq -> compressed_tensors, seen on the H200 2026-12-01)
       "vllm.model_executor.layers.quantization.auto_awq"]
# "serve-app" (last: it swaps the platform): build_app() of `vllm serve` for a generate model
# (its routes import their routers lazily), vLLM's CPU platform standing in for the GPU
SERVE_APP = """
import vllm.platforms, vllm.platforms.cpu
vllm.platforms._current_platform = vllm.platforms.cpu.CpuPlatform()
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
build_app(make_arg_parser(FlexibleArgumentParser()).parse_args([]), ("generate",))
"""
PROBE = """import importlib, sys
bad = 0
for m in sys.argv[2:]:
    try:
        exec(sys.argv[1]) if m == "serve-app" else importlib.import_module(m)
        print("OK  ", m)
    except BaseException as e:
        bad += 1
        print("FAIL", m + ":", type(e).__name__ + ":", str(e).splitlines()[0] if str(e) else "")
sys.exit(bad)
"""


def names(path: Path) -> set[str]:
    return {normalized_name(re.split(r"[=<>@ ]", line.strip())[0])
            for line in path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")}


def build_view(site: str, keep: set[str], view: str) -> None:
    """Symlink the kept distributions' files, each through its highest directory that
    holds no file of a hidden distribution."""
    kept, dirty = set(), set()
    for dist in md.distributions(path=[site]):
        files = [Path(f).parts for f in dist.files or [] if not str(f).startswith("..")]
        if normalized_name(dist.metadata["Name"]) in keep:
            kept.update(files)
        else:
            dirty.update(p[:i] for p in files for i in range(1, len(p)))
    done = set()
    for parts in kept:
        link = next(parts[:i] for i in range(1, len(parts) + 1) if parts[:i] not in dirty)
        src = os.path.join(site, *link)
        if link in done or link[-1].endswith(".pth") or not os.path.lexists(src):
            continue
        done.add(link)
        os.makedirs(os.path.join(view, *link[:-1]), exist_ok=True)
        os.symlink(src, os.path.join(view, *link))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("site_packages")
    p.add_argument("--module", action="append", default=None)
    p.add_argument("--also", action="append", default=[])
    p.add_argument("--hide", action="append", default=[])
    args = p.parse_args()
    keep = (names(HERE / "h200-pip-freeze.txt") | names(HERE / "h200-runtime-extras.txt")
            | {"vllm", "vllm-gguf-plugin"} | set(map(normalized_name, args.also))) \
        - set(map(normalized_name, args.hide))
    with tempfile.TemporaryDirectory() as view:
        build_view(os.path.abspath(args.site_packages), keep, view)
        res = subprocess.run([sys.executable, "-S", "-c", PROBE, SERVE_APP,
                              *(args.module or LLM + SERVE)],
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=view))
    lines = [line for line in res.stdout.splitlines() if line.startswith(("OK  ", "FAIL"))]
    print("\n".join(lines) or res.stderr.strip()[-2000:])
    print(f"{res.returncode} import errors" if res.returncode >= 0 else "the probe died")
    return res.returncode if res.returncode >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
