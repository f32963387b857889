#!/usr/bin/env python3
"""Build the GLM-5 overlay of vLLM: the pinned upstream wheels with the files of vllm_overlay/ copied in.

Two upstreams are pinned in upstream.lock: vLLM ([upstream]) and vLLM's GGUF support,
vllm-gguf-plugin ([plugin]). Overlay files live under vllm_overlay/<package>/ by their path in
that upstream's wheel. Both wheels get the version <upstream version>+<label>.<overlay digest>
and require each other exactly.

    python build.py wheel  [--out DIR] [--platform P]      build dist/vllm-<ver>+<label>.<digest>-...whl
                                                           and dist/vllm_gguf_plugin-<ver>+...whl
    python build.py check  [--platform P]                  lock/overlay consistency, byte-compile
    python build.py diff   [PATH ...]                      overlay files against their upstream base
    python build.py sdist  [PACKAGE]                       fetch a pinned sdist (upstream tests/)
    python build.py bundle --wheel W [--wheel W2] --exclude-from FREEZE.txt [--max-part 60M] [--out DIR]
                                                           offline install bundle for an air-gapped host
    python build.py rebase [--package P] --to X.Y.Z | --check latest
                                                           carry the overlay onto another release

Every command takes -q/-v. Exit codes: 0 ok, 2 usage, 3 download failed, 4 hash mismatch,
5 lock/overlay inconsistent or upstream drifted, 6 bundle dependency resolution failed,
7 rebase left files that need a maintainer (conflicts, deleted or added upstream).
"""
from __future__ import annotations

import argparse
import base64
import csv
import difflib
import hashlib
import io
import json
import os
import py_compile
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
LOCK = ROOT / "upstream.lock"
OVERLAY = ROOT / "vllm_overlay"
MARKER = "# overlay:"
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
# 1980-01-01, the earliest time a zip entry can carry; SOURCE_DATE_EPOCH overrides it.
ZIP_EPOCH = 315532800

EXIT_DOWNLOAD, EXIT_HASH, EXIT_LOCK, EXIT_BUNDLE, EXIT_REBASE = 3, 4, 5, 6, 7
VERBOSITY = 1


class BuildError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def log(msg: str, level: int = 1) -> None:
    if VERBOSITY >= level:
        print(msg, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def remove_stale_temps(folder: Path, prefix: str) -> None:
    """Remove `prefix<pid>-*` files an interrupted run of this tool left in `folder` (their
    process is gone); a live run's files stay."""
    for path in folder.glob(f"{prefix}*"):
        m = re.match(rf"{re.escape(prefix)}(\d+)-", path.name)
        if m is None or not path.is_file():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            log(f"removed {path}, left by an interrupted run", 2)
        except PermissionError:  # alive, another user's
            pass


def cache_dir() -> Path:
    base = os.environ.get("VLLM_OVERLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-overlay")
    path = Path(base) / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# Step 1: read the lock
# ---------------------------------------------------------------------------------------------
# The pinned upstreams, by their table in upstream.lock: vLLM itself, then (optional) the
# out-of-tree package that carries vLLM's GGUF support since vLLM 0.24.
PINS = ("upstream", "plugin")


def dist_name(package: str) -> str:
    """The package's name in wheel and dist-info names (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", package)


def module_name(package: str) -> str:
    """The import package a pinned project's overlay files live under (vllm_overlay/<it>/)."""
    return dist_name(package).lower()


def load_lock(path: Path = LOCK) -> dict:
    try:
        lock = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise BuildError(f"{path.name}: cannot read: {e}", EXIT_LOCK) from e
    up = lock.get("upstream", {})
    for key in ("package", "version", "label", "sdist", "wheels"):
        if key not in up:
            raise BuildError(f"{path.name}: [upstream] lacks '{key}'", EXIT_LOCK)
    # vLLM reads its own version: collect_env takes a last tuple part starting with "g" for a git
    # sha, and platform detection looks for "cpu" in it.
    if not re.fullmatch(r"[a-z][a-z0-9]*", up["label"]) or up["label"].startswith("g") \
            or "cpu" in up["label"]:
        raise BuildError(f"{path.name}: label {up['label']!r} must be lower-case letters and "
                         f"digits, not start with 'g' and not contain 'cpu'", EXIT_LOCK)
    for key in PINS[1:]:
        if key in lock:
            if not isinstance(lock[key], dict):
                raise BuildError(f"{path.name}: [{key}] must be a table", EXIT_LOCK)
            for field in ("package", "version", "sdist", "wheels"):
                if field not in lock[key]:
                    raise BuildError(f"{path.name}: [{key}] lacks '{field}'", EXIT_LOCK)
    for key in pins(lock):
        for field in ("package", "version"):
            if not isinstance(lock[key][field], str):
                raise BuildError(f"{path.name}: [{key}] {field} must be a quoted string, not "
                                 f"{lock[key][field]!r}", EXIT_LOCK)
        if not re.fullmatch(r"\d+(\.\d+)*", lock[key]["version"]):
            raise BuildError(f"{path.name}: [{key}] version {lock[key]['version']!r} is not a "
                             f"release number (X.Y.Z)", EXIT_LOCK)
        for name, entry in [("sdist", lock[key]["sdist"])] + [
                (f"wheels.{plat}", w) for plat, w in lock[key]["wheels"].items()]:
            for field in ("filename", "sha256"):
                if not isinstance(entry, dict) or not isinstance(entry.get(field), str):
                    raise BuildError(f"{path.name}: [{key}.{name}] needs {field} = \"...\"",
                                     EXIT_LOCK)
    lock.setdefault("overlay", {})
    lock.setdefault("requires", {})
    return lock


def pins(lock: dict) -> list[str]:
    """The lock's pinned upstreams, vLLM first."""
    return [key for key in PINS if key in lock]


def pin_of(lock: dict, rel: str) -> str | None:
    """The pin an overlay path ('vllm/...', 'vllm_gguf_plugin/...') belongs to."""
    top = rel.split("/", 1)[0]
    return next((k for k in pins(lock) if module_name(lock[k]["package"]) == top), None)


def wheel_entry(lock: dict, platform: str, key: str = "upstream") -> dict:
    wheels = lock[key]["wheels"]
    if platform not in wheels:
        raise BuildError(f"upstream.lock [{key}] pins no wheel for platform {platform!r} "
                         f"(pinned: {', '.join(sorted(wheels))})", EXIT_LOCK)
    return wheels[platform]


# ---------------------------------------------------------------------------------------------
# Step 2: fetch pinned files into the cache, sha256-checked
# ---------------------------------------------------------------------------------------------
def index_url() -> str:
    """The index pip would use: $PIP_INDEX_URL, pip's configuration, else pip's default."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True)
        url = out.stdout.strip() if out.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI  # pip's own default index
        url = PyPI.simple_url
    return url.rstrip("/")


def index_files(package: str) -> dict[str, dict]:
    """filename -> {url, sha256} for every file of `package` on the index (PEP 691 JSON)."""
    url = f"{index_url()}/{package}/"
    # A file:// index (a local mirror) is a folder per project with the JSON in index.json.
    local = url.startswith("file:")
    req = urllib.request.Request(url + "index.json" if local else url,
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = json.load(resp)
    except (OSError, ValueError) as e:
        raise BuildError(f"cannot read the package index at {url}: {e}", EXIT_DOWNLOAD) from e
    return {f["filename"]: {"url": urllib.parse.urljoin(url, f["url"]),
                            "sha256": f.get("hashes", {}).get("sha256")} for f in data["files"]}


def download(url: str, dest: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, open(dest, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            done, last = 0, 0.0
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                now = time.monotonic()
                if VERBOSITY >= 1 and (now - last > 2 or done == total):
                    pct = f" {100 * done / total:5.1f}%" if total else ""
                    log(f"  {dest.name.split('-', 2)[-1]}: {done / 2**20:8.1f} MiB{pct}")
                    last = now
    except OSError as e:
        raise BuildError(f"download of {url} failed: {e}", EXIT_DOWNLOAD) from e


def fetch(package: str, filename: str, sha256: str) -> Path:
    """Return the cached, hash-checked file; download it first if it is not cached."""
    path = cache_dir() / filename
    remove_stale_temps(path.parent, ".partial-")
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise BuildError(f"cached {path} is not a file (a directory?); upstream.lock expects the "
                         f"file {filename} there: remove it", EXIT_HASH)
    if path.exists():
        got = sha256_file(path)
        if got != sha256:
            raise BuildError(f"cached {path} has sha256 {got}, upstream.lock expects {sha256}; "
                             f"refusing it (delete the file to download it again)", EXIT_HASH)
        log(f"[fetch] {filename}: cached, sha256 ok", 2)
        return path
    files = index_files(package)
    if filename not in files:
        raise BuildError(f"{filename} is not on the package index", EXIT_DOWNLOAD)
    listed = files[filename]["sha256"]
    if listed and listed != sha256:
        raise BuildError(f"the index lists {filename} with sha256 {listed}, "
                         f"upstream.lock expects {sha256}", EXIT_HASH)
    log(f"[fetch] {filename}")
    partial = path.with_name(f".partial-{os.getpid()}-{filename}")
    try:
        download(files[filename]["url"], partial)
        got = sha256_file(partial)
        if got != sha256:
            raise BuildError(f"downloaded {filename} has sha256 {got}, upstream.lock expects "
                             f"{sha256}; not kept", EXIT_HASH)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def fetch_wheel(lock: dict, platform: str, key: str = "upstream") -> Path:
    entry = wheel_entry(lock, platform, key)
    return fetch(lock[key]["package"], entry["filename"], entry["sha256"])


def fetch_wheels(lock: dict, platform: str) -> dict[str, Path]:
    """Every pinned upstream wheel for `platform`, by pin."""
    return {key: fetch_wheel(lock, platform, key) for key in pins(lock)}


def fetch_sdist(lock: dict, key: str = "upstream") -> Path:
    entry = lock[key]["sdist"]
    return fetch(lock[key]["package"], entry["filename"], entry["sha256"])


# ---------------------------------------------------------------------------------------------
# Step 3: check the overlay against the lock and the upstream wheel
# ---------------------------------------------------------------------------------------------
def overlay_files(lock: dict) -> dict[str, Path]:
    """Wheel path ('vllm/...', 'vllm_gguf_plugin/...') -> file under vllm_overlay/; refuses
    anything outside the pinned upstreams' packages."""
    found = {}
    if not OVERLAY.is_dir():
        return found
    tops = sorted(module_name(lock[k]["package"]) for k in pins(lock))
    for path in sorted(OVERLAY.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        rel = path.relative_to(OVERLAY).as_posix()
        if path.is_symlink():
            raise BuildError(f"vllm_overlay/{rel}: symbolic links are not allowed", EXIT_LOCK)
        if path.is_dir():
            continue
        if pin_of(lock, rel) is None:
            raise BuildError(f"vllm_overlay/{rel}: overlay files must live under "
                             + " or ".join(f"vllm_overlay/{t}/" for t in tops)
                             + " (the packages upstream.lock pins)", EXIT_LOCK)
        found[rel] = path
    return found


def check_lock_paths(lock: dict) -> None:
    for rel, entry in lock["overlay"].items():
        parts = rel.split("/")
        if pin_of(lock, rel) is None or ".." in parts or "" in parts or rel.startswith("/"):
            raise BuildError(f"upstream.lock: overlay path {rel!r} escapes the pinned "
                             f"packages ({', '.join(module_name(lock[k]['package']) + '/' for k in pins(lock))})",
                             EXIT_LOCK)
        if not isinstance(entry, dict) or (entry.get("new") is not True
                                           and not entry.get("base_sha256")):
            raise BuildError(f"upstream.lock: overlay entry {rel!r} needs base_sha256 = ... "
                             f"(replaces an upstream file) or new = true", EXIT_LOCK)
    paths = list(lock["overlay"])
    for before, after in zip(paths, paths[1:]):
        if after < before:  # `rebase` writes them sorted: keep a round trip byte for byte
            raise BuildError(f"upstream.lock: overlay entry {after!r} belongs before "
                             f"{before!r} (entries are sorted by path)", EXIT_LOCK)


def marker_problems(rel: str, base: str, ours: str) -> list[str]:
    """Changed hunks of a replaced file that carry no '# overlay:' comment near them."""
    a, b = base.splitlines(), ours.splitlines()
    problems = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        window = b[max(0, j1 - 3):j2]
        if not any(MARKER in line for line in window):
            problems.append(f"{rel}:{j1 + 1}: changed hunk without an '{MARKER}' comment")
    return problems


def check_overlay(lock: dict, wheels: dict[str, Path]) -> dict[str, Path]:
    """All consistency checks against the pinned wheels (by pin); returns the overlay map.
    Raises BuildError listing every problem."""
    check_lock_paths(lock)
    files = overlay_files(lock)
    problems = []
    zips = {key: zipfile.ZipFile(path) for key, path in wheels.items()}
    try:
        names = {key: set(zf.namelist()) for key, zf in zips.items()}
        for rel in sorted(set(files) - set(lock["overlay"])):
            key = pin_of(lock, rel)
            entry = (f'base_sha256 = "{hashlib.sha256(zips[key].read(rel)).hexdigest()}"'
                     if rel in names[key] else "new = true")
            problems.append(f"vllm_overlay/{rel} is not listed in upstream.lock [overlay] "
                            f"(record it as [overlay.\"{rel}\"] {entry})")
        for rel in sorted(set(lock["overlay"]) - set(files)):
            problems.append(f"upstream.lock lists {rel}, but vllm_overlay/{rel} does not exist")
        for rel, entry in sorted(lock["overlay"].items()):
            if rel not in files:
                continue
            key = pin_of(lock, rel)
            wheel = wheels[key]
            if entry.get("new") is True:
                if rel in names[key]:
                    problems.append(f"{rel} is marked new but upstream has it: record its "
                                    f"base_sha256 instead")
                continue
            if rel not in names[key]:
                problems.append(f"{rel}: upstream {wheel.name} has no such file (deleted or "
                                f"renamed upstream?): rebase the overlay")
                continue
            data = zips[key].read(rel)
            got = hashlib.sha256(data).hexdigest()
            if got != entry["base_sha256"]:
                problems.append(f"{rel}: upstream file drifted (sha256 {got}, upstream.lock "
                                f"base {entry['base_sha256']}): rebase the overlay onto it")
                continue
            problems += marker_problems(rel, data.decode(), files[rel].read_text())
    finally:
        for zf in zips.values():
            zf.close()
    for rel, path in sorted(files.items()):
        if re.search(r"^(<<<<<<< |>>>>>>> )", path.read_text(errors="replace"), re.M):
            problems.append(f"vllm_overlay/{rel} has unresolved merge conflict markers")
    if problems:
        raise BuildError("overlay check failed:\n  " + "\n  ".join(problems), EXIT_LOCK)
    return files


def byte_compile(files: dict[str, Path]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for rel, path in files.items():
            if path.suffix == ".py":
                try:
                    py_compile.compile(str(path), cfile=os.path.join(tmp, "x.pyc"), doraise=True)
                except py_compile.PyCompileError as e:
                    raise BuildError(f"vllm_overlay/{rel} does not compile: {e.msg}",
                                     EXIT_LOCK) from e


# ---------------------------------------------------------------------------------------------
# Step 4: write the overlay wheel
# ---------------------------------------------------------------------------------------------
def overlay_digest(lock_text: bytes, files: dict[str, Path]) -> str:
    h = hashlib.sha256(lock_text)
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel].read_bytes() + b"\0")
    return h.hexdigest()[:8]


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def requirement_name(line: str) -> str:
    """The normalized project name of a 'Requires-Dist: ...' line."""
    name = re.split(r"[\s;<>=!~\[(]", line[len("Requires-Dist: "):], maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def rewrite_metadata(text: str, version: str, requires: dict[str, str],
                     pinned: dict[str, str] | None = None) -> str:
    """METADATA with the overlay version; unconditional requirements named in `requires`
    replaced (each must exist upstream); every requirement on a project in `pinned` (the
    sibling overlay wheel) replaced by the exact pin, keeping its marker, and an
    unconditional one added where upstream has none."""
    pinned = pinned or {}
    lines, seen, seen_pinned = [], set(), set()
    last_requirement = None
    for line in text.split("\n"):
        if line.startswith("Version: "):
            line = f"Version: {version}"
        elif line.startswith("Requires-Dist: "):
            key = requirement_name(line)
            marker = line.split(";", 1)[1] if ";" in line else None
            if key in pinned:
                line = f"Requires-Dist: {pinned[key]}" + (f";{marker}" if marker else "")
                if marker is None:
                    seen_pinned.add(key)
            elif key in requires and "extra ==" not in (marker or ""):
                if key in seen:
                    continue
                seen.add(key)
                line = f"Requires-Dist: {requires[key]}"
            last_requirement = len(lines)
        lines.append(line)
    missing = set(requires) - seen
    if missing:
        raise BuildError(f"upstream.lock [requires] names {sorted(missing)}, which upstream "
                         f"METADATA does not require", EXIT_LOCK)
    add = [f"Requires-Dist: {pinned[k]}" for k in sorted(set(pinned) - seen_pinned)]
    if add:
        at = len(lines) if last_requirement is None else last_requirement + 1
        if last_requirement is None:  # after the header fields, before the description
            at = next((i for i, ln in enumerate(lines) if ln == ""), len(lines))
        lines[at:at] = add
    return "\n".join(lines)


def zip_time() -> tuple:
    epoch = max(int(os.environ.get("SOURCE_DATE_EPOCH", ZIP_EPOCH)), ZIP_EPOCH)
    return time.gmtime(epoch)[:6]


def entry_info(name: str, mode: int, date_time: tuple) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time)
    info.create_system = 3  # unix, so that the mode bits below are honoured
    info.external_attr = ((0o755 if mode & 0o111 else 0o644) | 0o100000) << 16
    return info


def copy_raw(src: zipfile.ZipFile, info: zipfile.ZipInfo, dst: zipfile.ZipFile,
             date_time: tuple) -> None:
    """Copy one member's compressed bytes as they are: no decompression, no recompression."""
    src.fp.seek(info.header_offset)
    header = src.fp.read(zipfile.sizeFileHeader)
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30],
                                                                                   "little")
    src.fp.seek(info.header_offset + zipfile.sizeFileHeader + name_len + extra_len)
    raw = src.fp.read(info.compress_size)
    new = entry_info(info.filename, info.external_attr >> 16, date_time)
    new.compress_type, new.CRC = info.compress_type, info.CRC
    new.compress_size, new.file_size = info.compress_size, info.file_size
    new.header_offset = dst.fp.tell()
    # zipfile has no public raw-copy call; this writes what ZipFile.write would, minus compression.
    dst.fp.write(new.FileHeader(zip64=None))
    dst.fp.write(raw)
    dst.start_dir = dst.fp.tell()
    dst.filelist.append(new)
    dst.NameToInfo[new.filename] = new
    dst._didModify = True


def overlay_version(lock: dict, key: str, digest: str) -> str:
    return f"{lock[key]['version']}+{lock['upstream']['label']}.{digest}"


def build_wheels(lock: dict, platform: str, out_dir: Path) -> list[Path]:
    """The overlay wheel of every pinned upstream, vLLM first; all carry one digest (of the
    lock and every overlay file) and require each other exactly."""
    t0 = time.monotonic()
    wheels = fetch_wheels(lock, platform)
    files = check_overlay(lock, wheels)
    byte_compile(files)
    digest = overlay_digest(LOCK.read_bytes(), files)
    exact = {re.sub(r"[-_.]+", "-", lock[k]["package"]).lower():
             f"{lock[k]['package']}=={overlay_version(lock, k, digest)}" for k in pins(lock)}
    built = []
    for key in pins(lock):
        own = re.sub(r"[-_.]+", "-", lock[key]["package"]).lower()
        requires = lock["requires"] if key == "upstream" else {}
        built.append(write_wheel(
            lock, key, wheels[key], {r: p for r, p in files.items() if pin_of(lock, r) == key},
            overlay_version(lock, key, digest), requires,
            {k: v for k, v in exact.items() if k != own}, out_dir))
    log(f"[wheel] {', '.join(w.name for w in built)} ({len(files)} overlay files, "
        f"{time.monotonic() - t0:.1f} s)")
    return built


def write_wheel(lock: dict, key: str, wheel: Path, files: dict[str, Path], version: str,
                requires: dict[str, str], pinned: dict[str, str], out_dir: Path) -> Path:
    """`wheel` with `files` copied in, as version `version`, written atomically to out_dir."""
    up = lock[key]
    dist = dist_name(up["package"])
    old_info = f"{dist}-{up['version']}.dist-info/"
    new_info = f"{dist}-{version}.dist-info/"
    requires = {re.sub(r"[-_.]+", "-", k).lower(): v for k, v in requires.items()}
    out_name = wheel.name.replace(f"-{up['version']}-", f"-{version}-", 1)
    date_time = zip_time()

    replaced: dict[str, bytes] = {rel: path.read_bytes() for rel, path in files.items()}
    with zipfile.ZipFile(wheel) as src:
        infos = {i.filename: i for i in src.infolist()}
        if old_info + "RECORD" not in infos or old_info + "METADATA" not in infos:
            raise BuildError(f"{wheel.name} lacks {old_info}RECORD or METADATA", EXIT_LOCK)
        if key == "upstream":  # vLLM reports its version from its generated module
            if "vllm/_version.py" not in infos:
                raise BuildError(f"{wheel.name} lacks vllm/_version.py", EXIT_LOCK)
            replaced["vllm/_version.py"] = version_module(
                src.read("vllm/_version.py").decode(), version)
        record = {row[0]: row for row in csv.reader(io.StringIO(
            src.read(old_info + "RECORD").decode())) if row}
        meta = {old_info + "METADATA": rewrite_metadata(
            src.read(old_info + "METADATA").decode(), version, requires, pinned)}

        out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out_dir, ".building-")
        fd, tmp_name = tempfile.mkstemp(prefix=f".building-{os.getpid()}-", suffix=".whl",
                                        dir=out_dir)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            rows = []
            with zipfile.ZipFile(tmp, "w") as dst:
                names = sorted(set(infos) | set(replaced))
                body = [n for n in names if not n.startswith(old_info) and not n.endswith("/")]
                for name in body:
                    if name in replaced:
                        data = replaced[name]
                        mode = infos[name].external_attr >> 16 if name in infos else 0o644
                        dst.writestr(entry_info(name, mode, date_time), data,
                                     compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                        rows.append([name, record_hash(data), str(len(data))])
                    else:
                        copy_raw(src, infos[name], dst, date_time)
                        if name not in record or not record[name][1]:
                            raise BuildError(f"{wheel.name}: RECORD has no hash for {name}",
                                             EXIT_LOCK)
                        rows.append(record[name])
                for name in sorted(n for n in infos if n.startswith(old_info)
                                   and not n.endswith("RECORD") and not n.endswith("/")):
                    new_name = new_info + name[len(old_info):]
                    data = meta[name].encode() if name in meta else src.read(name)
                    dst.writestr(entry_info(new_name, 0o644, date_time), data,
                                 compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                    rows.append([new_name, record_hash(data), str(len(data))])
                rows.append([new_info + "RECORD", "", ""])
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                dst.writestr(entry_info(new_info + "RECORD", 0o644, date_time),
                             buf.getvalue().encode(), compress_type=zipfile.ZIP_DEFLATED,
                             compresslevel=9)
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o666 & ~umask)  # mkstemp makes it 0600
            target = out_dir / out_name
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
    # dist/ holds one build of each package per platform: older overlay wheels (of this or
    # an earlier pin) would shadow it in `pip install dist/*.whl`.
    tail = out_name.split("-", 2)[2]
    for stale in out_dir.glob(f"{dist}-*+{lock['upstream']['label']}.*-{tail}"):
        if stale.name != out_name:
            stale.unlink()
            log(f"[wheel] removed older build {stale.name}", 2)
    return target


def version_module(upstream: str, version: str) -> bytes:
    """Upstream's generated vllm/_version.py with the overlay version put in."""
    base, _, local = version.partition("+")
    parts = tuple(int(p) for p in base.split(".")) + ((local,) if local else ())
    text, n1 = re.subn(r"^__version__ = version = .*$", f"__version__ = version = {version!r}",
                       upstream, flags=re.M)
    text, n2 = re.subn(r"^__version_tuple__ = version_tuple = .*$",
                       f"__version_tuple__ = version_tuple = {parts!r}", text, flags=re.M)
    if (n1, n2) != (1, 1):
        raise BuildError("vllm/_version.py upstream no longer has the version lines build.py "
                         "rewrites", EXIT_LOCK)
    return text.encode()


# ---------------------------------------------------------------------------------------------
# Other commands
# ---------------------------------------------------------------------------------------------
def cmd_check(args) -> int:
    lock = load_lock()
    files = check_overlay(lock, fetch_wheels(lock, args.platform))
    byte_compile(files)
    for key in pins(lock):
        mine = [r for r in files if pin_of(lock, r) == key]
        new = sum(1 for r in mine if lock["overlay"][r].get("new") is True)
        log(f"[check] {lock[key]['package']} {lock[key]['version']}: ok, {len(mine) - new} "
            f"replaced and {new} new overlay files")
    return 0


def cmd_diff(args) -> int:
    lock = load_lock()
    wheels = fetch_wheels(lock, args.platform)
    wanted = {p.removeprefix("vllm_overlay/") for p in args.paths}
    unknown = sorted(wanted - set(lock["overlay"]))
    if unknown:
        raise BuildError(f"not overlay files in upstream.lock: {', '.join(unknown)}", 2)
    for rel, entry in sorted(lock["overlay"].items()):
        if entry.get("new") is True or (wanted and rel not in wanted):
            continue
        with zipfile.ZipFile(wheels[pin_of(lock, rel)]) as zf:
            base = zf.read(rel).decode().splitlines(keepends=True)
        ours = (OVERLAY / rel).read_text().splitlines(keepends=True)
        sys.stdout.writelines(difflib.unified_diff(base, ours, f"a/{rel}", f"b/{rel}"))
    return 0


def cmd_sdist(args) -> int:
    lock = load_lock()
    key = next((k for k in pins(lock) if re.sub(r"[-_.]+", "-", lock[k]["package"]).lower()
                == re.sub(r"[-_.]+", "-", args.package).lower()), None)
    if key is None:
        raise BuildError(f"upstream.lock pins no package {args.package!r} (pinned: "
                         f"{', '.join(lock[k]['package'] for k in pins(lock))})", 2)
    print(fetch_sdist(lock, key))
    return 0


def cmd_wheel(args) -> int:
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        raise BuildError(f"--out {out}: exists and is not a directory", 2)
    for wheel in build_wheels(load_lock(), args.platform, out):
        print(wheel)
    return 0


# --- bundle (tools/bundle.py) and rebase (tools/rebase.py) ---------------------------------
def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 60M)")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]


def tool(name: str):
    """Import tools/<name>.py; its `import build` finds this module, not a second copy."""
    sys.path.insert(0, str(ROOT / "tools"))
    sys.modules.setdefault("build", sys.modules[__name__])
    import importlib

    return importlib.import_module(name)


def cmd_bundle(args) -> int:
    return tool("bundle").bundle(args)


def cmd_rebase(args) -> int:
    rebase = tool("rebase")
    report = Path(args.report) if args.report else None
    if args.resume or args.abort:
        return rebase.resume(abort=args.abort)
    if args.check:
        return rebase.rebase(args.check, False, True, report, args.package)
    return rebase.rebase(args.to, args.allow_conflicts, False, report, args.package)


def main(argv: list[str] | None = None) -> int:
    global VERBOSITY
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="errors only")
    common.add_argument("-v", "--verbose", action="store_true", help="more detail")
    common.add_argument("--platform", default=DEFAULT_PLATFORM,
                        help=f"wheel platform pinned in upstream.lock (default {DEFAULT_PLATFORM})")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("wheel", parents=[common], help="build the overlay wheel")
    p.add_argument("--out", default=str(ROOT / "dist"), help="output folder (default dist/)")
    p.set_defaults(func=cmd_wheel)
    p = sub.add_parser("check", parents=[common], help="check lock and overlay, byte-compile")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("diff", parents=[common], help="diff replaced files against upstream")
    p.add_argument("paths", nargs="*", help="overlay paths (vllm/...); default: all")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("sdist", parents=[common], help="fetch a pinned sdist, print its path")
    p.add_argument("package", nargs="?", default="vllm", help="pinned package (default vllm)")
    p.set_defaults(func=cmd_sdist)
    p = sub.add_parser("bundle", parents=[common], help="offline install bundle")
    p.add_argument("--wheel", required=True, action="append",
                   help="a wheel to bundle (e.g. dist/vllm-*.whl); give it again for each wheel")
    p.add_argument("--exclude-from", required=True,
                   help="`pip freeze` of the target: packages it already has")
    p.add_argument("--max-part", type=parse_size, default=parse_size("60M"))
    p.add_argument("--python-version", default="3.12", help="target Python (default 3.12)")
    p.add_argument("--only", metavar="REQS",
                   help="bundle just these name==version pins (installed without their "
                        "dependencies) instead of the wheel's whole dependency closure")
    p.add_argument("--drop", action="append", default=[], metavar="GLOB",
                   help="leave wheel members matching GLOB out of the bundled wheel "
                        "(e.g. kernels the target never loads); RECORD follows")
    p.add_argument("--out", default=str(ROOT / ".bundle"))
    p.set_defaults(func=cmd_bundle)
    p = sub.add_parser("rebase", parents=[common], help="carry the overlay onto another release")
    p.add_argument("--package", default="vllm",
                   help="the pinned upstream to move (default vllm; vllm-gguf-plugin for the "
                        "GGUF plugin, pinned by its first rebase)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--to", metavar="X.Y.Z", help="merge the overlay onto this release")
    group.add_argument("--check", metavar="X.Y.Z|latest",
                       help="dry run: report what a rebase would do, write nothing")
    group.add_argument("--continue", dest="resume", action="store_true",
                       help="after resolving conflicts: move the pin")
    group.add_argument("--abort", action="store_true", help="restore the overlay files")
    p.add_argument("--allow-conflicts", action="store_true",
                   help="update upstream.lock even if files need a maintainer")
    p.add_argument("--report", metavar="JSON", help="also write the report as JSON")
    p.set_defaults(func=cmd_rebase)
    args = parser.parse_args(argv)
    if args.command == "bundle":
        args.platform = [args.platform] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + [
            "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"] \
            if args.platform.endswith("x86_64") else [args.platform]
    VERBOSITY = 0 if args.quiet else 2 if args.verbose else 1
    try:
        return args.func(args)
    except BuildError as e:
        print(f"build.py {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:  # e.g. `build.py diff | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
