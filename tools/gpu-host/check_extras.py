# SPDX-License-Identifier: Apache-2.0
"""Do the H200 host's packages plus the bundle's extras import what a command needs?

    python tools/gpu-host/check_extras.py SITE_PACKAGES [--module M ...] [--also NAME ...]

SITE_PACKAGES is a full vLLM install (e.g. the CI venv's). The script builds a view of
it holding only the distributions in h200-pip-freeze.txt and h200-runtime-extras.txt
(plus vllm and any --also), imports the modules in a fresh `python -S` on that view,
and prints OK or the import error. Default modules: what `vllm serve` imports.
--also names distributions the view should keep although the host lacks them, for
version differences (e.g. httpx2, which a newer openai here needs and the host's
older one does not).
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
SERVE = ["vllm.entrypoints.cli.main", "vllm.entrypoints.cli.launch",
         "vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.serve"]


def names(path: Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.add(re.split(r"[=<>@ ]", line)[0].lower().replace("_", "-"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("site_packages")
    p.add_argument("--module", action="append", default=None)
    p.add_argument("--also", action="append", default=[])
    args = p.parse_args()
    keep = (names(HERE / "h200-pip-freeze.txt") | names(HERE / "h200-runtime-extras.txt")
            | {"vllm"} | {a.lower().replace("_", "-") for a in args.also})
    entries = set()
    for dist in md.distributions(path=[args.site_packages]):
        if dist.metadata["Name"].lower().replace("_", "-") in keep:
            entries |= {str(f).split("/")[0] for f in dist.files or []
                        if not str(f).startswith("..")}
    with tempfile.TemporaryDirectory() as view:
        for entry in entries:
            src = os.path.join(args.site_packages, entry)
            if os.path.exists(src) and not entry.endswith(".pth"):
                os.symlink(src, os.path.join(view, entry))
        code = "import " + ", ".join(args.module or SERVE) + "; print('OK')"
        res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=view))
    if "OK" in res.stdout.split():
        print("OK")
        return 0
    print(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed")
    return 1


if __name__ == "__main__":
    sys.exit(main())
