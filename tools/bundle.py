"""`python build.py bundle`: an offline install bundle for an air-gapped host.

The wheels (`--wheel`, once per wheel: the vLLM and the GGUF plugin overlay wheels) plus
the dependency wheels the host lacks, given its `pip freeze`: either the whole dependency
closure as pip resolves it for the target (`pip install --dry-run --report` against a
stand-in environment holding the freeze's packages), or just the pins of `--only`.
Members the host never loads can be dropped from the bundled wheels (`--drop`, RECORD
rewritten; each pattern must match in some wheel). Output: a deterministic tar split into
checksummed parts, `SHA256SUMS` and `install.sh`.
"""
from __future__ import annotations

import csv
import fnmatch
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from tools.common import (EXIT_BUNDLE, EXIT_DOWNLOAD, BuildError, copy_raw, entry_info, log,
                          normalized_name, sha256_file)


def freeze_pins(freeze: Path) -> dict[str, str]:
    pins = {}
    for line in freeze.read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)", line.split("#")[0].strip())
        if m:
            pins[normalized_name(m.group(1))] = m.group(2)
    return pins


def fake_environment(freeze: Path, root: Path) -> Path:
    """A venv whose site-packages holds stub metadata of the target's packages (pip freeze);
    lines that are not name==version (editable installs, direct references) are left out."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    for name, version in freeze_pins(freeze).items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("freeze\n")
    return root / "bin" / "python"


def pinned_lacking(only: Path, freeze: Path) -> list[str]:
    """`name==version` lines of `only` that the target's freeze does not have."""
    have = freeze_pins(freeze)
    wanted = freeze_pins(only)
    if not wanted:
        raise BuildError(f"{only}: no 'name==version' lines", EXIT_BUNDLE)
    return [f"{n}=={v}" for n, v in sorted(wanted.items()) if have.get(n) != v]


def resolve_lacking(wheels: list[Path], freeze: Path, target: list[str],
                    tmp: Path) -> list[str]:
    """The wheels' whole dependency closure for the target, minus what it has (pip's resolver
    run against a stand-in environment holding the freeze's packages)."""
    python = fake_environment(freeze, tmp / "target")
    report = tmp / "report.json"
    log(f"[bundle] resolving {', '.join(w.name for w in wheels)} against {freeze.name}")
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                          "--dry-run", "--quiet", "--report", str(report), *target,
                          *map(str, wheels)],
                         capture_output=True, text=True)
    if "Can not use any platform or abi specific options" in res.stderr:
        raise BuildError("this pip cannot resolve for another platform without --target; "
                         "upgrade it: python -m pip install -U 'pip>=25'", EXIT_BUNDLE)
    if res.returncode != 0:
        raise BuildError(f"pip could not resolve the dependencies:\n{res.stderr.strip()}",
                         EXIT_BUNDLE)
    return [f"{i['metadata']['name']}=={i['metadata']['version']} "
            f"--hash=sha256:{i['download_info']['archive_info']['hashes']['sha256']}"
            for i in json.loads(report.read_text())["install"]
            if not i.get("is_direct")]  # the wheel itself, given as a path


def dropped_members(wheel: Path, patterns: list[str]) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return {n for n in zf.namelist() if any(fnmatch.fnmatch(n, p) for p in patterns)}


def slim_wheel(src_path: Path, dst_path: Path, patterns: list[str]) -> None:
    """Copy a wheel without the members matching any glob; RECORD follows."""
    dropped = dropped_members(src_path, patterns)
    if not dropped:
        shutil.copy2(src_path, dst_path)
        return
    with zipfile.ZipFile(src_path) as src, zipfile.ZipFile(dst_path, "w") as dst:
        infos = src.infolist()
        for info in infos:
            if info.filename in dropped:
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in csv.reader(io.StringIO(src.read(info).decode()))
                        if r and r[0] not in dropped]
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                dst.writestr(entry_info(info.filename, 0o644, info.date_time),
                             buf.getvalue().encode(), compress_type=zipfile.ZIP_DEFLATED)
            else:
                copy_raw(src, info, dst, info.date_time)
    log(f"[bundle] dropped {len(dropped)} members from {src_path.name}")


def bundle(wheel_files: list[str], *, exclude_from: str, out: str, max_part: int,
           python_version: str, platforms: list[str], only: str | None,
           drop: list[str]) -> int:
    """The bundle of `wheel_files` for a host whose `pip freeze` is `exclude_from`, in parts of
    at most `max_part` bytes under `out`; `only`: a file of name==version pins to bundle instead
    of the dependency closure; `drop`: globs of wheel members to leave out."""
    wheels_in = [Path(w).resolve() for w in wheel_files]
    freeze = Path(exclude_from).resolve()
    for p in (*wheels_in, freeze):
        if not p.is_file():
            raise BuildError(f"{p}: no such file", 2)
    for pattern in drop:
        if not any(dropped_members(w, [pattern]) for w in wheels_in):
            raise BuildError(f"--drop {pattern!r} matches nothing in "
                             f"{', '.join(w.name for w in wheels_in)}", EXIT_BUNDLE)
    out = Path(out).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wheels = tmp / "bundle" / "wheels"
        wheels.mkdir(parents=True)
        for wheel in wheels_in:
            slim_wheel(wheel, wheels / wheel.name, drop)
        target = ["--only-binary=:all:", "--python-version", python_version,
                  "--implementation", "cp", *[a for p in platforms for a in ("--platform", p)]]
        if only:
            needed = pinned_lacking(Path(only), freeze)
        else:
            needed = resolve_lacking(wheels_in, freeze, target, tmp)
        log(f"[bundle] the target lacks {len(needed)} packages")
        if needed:
            reqs = tmp / "reqs.txt"
            reqs.write_text("".join(f"{r}\n" for r in needed))
            res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                  "-r", str(reqs), "-d", str(wheels), *target],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise BuildError(f"pip download failed:\n{res.stderr.strip()}", EXIT_DOWNLOAD)
        (tmp / "bundle" / "install.sh").write_text(INSTALL_SH)
        manifest = "".join(f"{sha256_file(w)}  wheels/{w.name}\n" for w in sorted(wheels.iterdir()))
        (tmp / "bundle" / "MANIFEST.sha256").write_text(manifest)
        tar_path = tmp / "bundle.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted((tmp / "bundle").rglob("*")):
                info = tar.gettarinfo(str(path), str(path.relative_to(tmp)))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if info.isfile():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
        out.mkdir(parents=True, exist_ok=True)
        for old in list(out.glob("part-*")) + [out / "SHA256SUMS", out / "install.sh"]:
            old.unlink(missing_ok=True)
        parts = []
        with open(tar_path, "rb") as f:
            while chunk := f.read(max_part):
                part = out / f"part-{len(parts):02d}"
                part.write_bytes(chunk)
                parts.append(part)
        (out / "install.sh").write_text(INSTALL_SH)
        (out / "SHA256SUMS").write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in parts))
    log(f"[bundle] {out}: {len(parts)} parts of at most {max_part} bytes; on the target: "
        f"bash install.sh PARTS_DIR [SITE]")
    return 0


INSTALL_SH = r"""#!/usr/bin/env bash
# Offline install of a bundle made by `python build.py bundle`.
#   bash install.sh PARTS_DIR [SITE]
# Without SITE: pip installs into the running Python environment.
# With SITE: installs into that folder and writes SITE/env.sh (source it: sets PYTHONPATH, and
# PATH for the console scripts such as `vllm`).
set -euo pipefail
parts="${1:?usage: install.sh PARTS_DIR [SITE]}"; site="${2:-}"
(cd "$parts" && sha256sum -c --quiet SHA256SUMS)
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cat "$parts"/part-* | tar -C "$work" -xf -
(cd "$work/bundle" && sha256sum -c --quiet MANIFEST.sha256)
if [ -n "$site" ]; then
  mkdir -p "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$work"/bundle/wheels/*.whl
  printf 'export PYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}"\nexport PATH="%s/bin:$PATH"\n' \
    "$site" "$site" > "$site/env.sh"
  PYTHONPATH="$site" python3 -c 'import vllm; print("vllm", vllm.__version__, "installed")'
else
  python3 -m pip install -q --no-index --no-deps "$work"/bundle/wheels/*.whl
  python3 -c 'import vllm; print("vllm", vllm.__version__, "installed")'
fi
"""
