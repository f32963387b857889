"""The pinned upstreams: upstream.lock, the package index and the download cache, and the
overlay's files by the pin they belong to."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

from tools.common import (EXIT_DOWNLOAD, EXIT_HASH, EXIT_LOCK, BuildError, dist_name, log,
                          remove_stale_temps, sha256_file)

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "upstream.lock"
OVERLAY = ROOT / "vllm_overlay"
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"


def cache_dir() -> Path:
    base = os.environ.get("VLLM_OVERLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-overlay")
    path = Path(base) / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------
# The pinned upstreams, by their table in upstream.lock: vLLM itself, then (optional) the
# out-of-tree package that carries vLLM's GGUF support since vLLM 0.24.
PINS = ("upstream", "plugin")


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
# Pinned files, fetched into the cache and sha256-checked
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
                if now - last > 2 or done == total:
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
# The overlay's files
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
