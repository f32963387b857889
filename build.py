#!/usr/bin/env python3
"""Build the GLM-5 overlay of vLLM: the pinned upstream wheel with the files of vllm_overlay/ copied in.

    python build.py wheel  [--out DIR] [--platform P]      build dist/vllm-<ver>+<label>.<digest>-...whl
    python build.py check  [--platform P]                  lock/overlay consistency, byte-compile
    python build.py diff   [PATH ...]                      overlay files against their upstream base
    python build.py sdist                                  fetch the pinned sdist (upstream tests/)
    python build.py bundle --wheel W --exclude-from FREEZE.txt [--max-part 60M] [--out DIR]
                                                           offline install bundle for an air-gapped host
    python build.py rebase --to X.Y.Z | --check latest     carry the overlay onto another release

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


def cache_dir() -> Path:
    base = os.environ.get("VLLM_OVERLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-overlay")
    path = Path(base) / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# Step 1: read the lock
# ---------------------------------------------------------------------------------------------
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
    lock.setdefault("overlay", {})
    lock.setdefault("requires", {})
    return lock


def wheel_entry(lock: dict, platform: str) -> dict:
    wheels = lock["upstream"]["wheels"]
    if platform not in wheels:
        raise BuildError(f"upstream.lock pins no wheel for platform {platform!r} "
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
                    log(f"  {dest.name.removeprefix('.partial-')}: {done / 2**20:8.1f} MiB{pct}")
                    last = now
    except OSError as e:
        raise BuildError(f"download of {url} failed: {e}", EXIT_DOWNLOAD) from e


def fetch(package: str, filename: str, sha256: str) -> Path:
    """Return the cached, hash-checked file; download it first if it is not cached."""
    path = cache_dir() / filename
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
    partial = path.with_name(f".partial-{filename}")
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


def fetch_wheel(lock: dict, platform: str) -> Path:
    entry = wheel_entry(lock, platform)
    return fetch(lock["upstream"]["package"], entry["filename"], entry["sha256"])


def fetch_sdist(lock: dict) -> Path:
    entry = lock["upstream"]["sdist"]
    return fetch(lock["upstream"]["package"], entry["filename"], entry["sha256"])


# ---------------------------------------------------------------------------------------------
# Step 3: check the overlay against the lock and the upstream wheel
# ---------------------------------------------------------------------------------------------
def overlay_files() -> dict[str, Path]:
    """Wheel path ('vllm/...') -> file under vllm_overlay/; refuses anything outside vllm/."""
    found = {}
    if not OVERLAY.is_dir():
        return found
    for path in sorted(OVERLAY.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        rel = path.relative_to(OVERLAY).as_posix()
        if path.is_symlink():
            raise BuildError(f"vllm_overlay/{rel}: symbolic links are not allowed", EXIT_LOCK)
        if path.is_dir():
            continue
        if not rel.startswith("vllm/"):
            raise BuildError(f"vllm_overlay/{rel}: overlay files must live under vllm_overlay/vllm/",
                             EXIT_LOCK)
        found[rel] = path
    return found


def check_lock_paths(lock: dict) -> None:
    for rel, entry in lock["overlay"].items():
        parts = rel.split("/")
        if parts[0] != "vllm" or ".." in parts or "" in parts or rel.startswith("/"):
            raise BuildError(f"upstream.lock: overlay path {rel!r} escapes vllm/", EXIT_LOCK)
        if entry.get("new") is not True and not entry.get("base_sha256"):
            raise BuildError(f"upstream.lock: overlay entry {rel!r} needs base_sha256 = ... "
                             f"(replaces an upstream file) or new = true", EXIT_LOCK)


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


def check_overlay(lock: dict, wheel: Path) -> dict[str, Path]:
    """All consistency checks; returns the overlay map. Raises BuildError listing every problem."""
    check_lock_paths(lock)
    files = overlay_files()
    problems = []
    for rel in sorted(set(files) - set(lock["overlay"])):
        problems.append(f"vllm_overlay/{rel} is not listed in upstream.lock [overlay]")
    for rel in sorted(set(lock["overlay"]) - set(files)):
        problems.append(f"upstream.lock lists {rel}, but vllm_overlay/{rel} does not exist")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for rel, entry in sorted(lock["overlay"].items()):
            if rel not in files:
                continue
            if entry.get("new") is True:
                if rel in names:
                    problems.append(f"{rel} is marked new but upstream has it: record its "
                                    f"base_sha256 instead")
                continue
            if rel not in names:
                problems.append(f"{rel}: upstream {wheel.name} has no such file (deleted or "
                                f"renamed upstream?): rebase the overlay")
                continue
            data = zf.read(rel)
            got = hashlib.sha256(data).hexdigest()
            if got != entry["base_sha256"]:
                problems.append(f"{rel}: upstream file drifted (sha256 {got}, upstream.lock "
                                f"base {entry['base_sha256']}): rebase the overlay onto it")
                continue
            problems += marker_problems(rel, data.decode(), files[rel].read_text())
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


def rewrite_metadata(text: str, version: str, requires: dict[str, str]) -> str:
    lines, seen = [], set()
    for line in text.split("\n"):
        if line.startswith("Version: "):
            line = f"Version: {version}"
        elif line.startswith("Requires-Dist: "):
            name = re.split(r"[\s;<>=!~\[(]", line[len("Requires-Dist: "):], maxsplit=1)[0]
            key = re.sub(r"[-_.]+", "-", name).lower()
            if key in requires:
                marker = line.split(";", 1)[1] if ";" in line else None
                if "extra ==" not in (marker or ""):
                    if key in seen:
                        continue
                    seen.add(key)
                    line = f"Requires-Dist: {requires[key]}"
        lines.append(line)
    missing = set(requires) - seen
    if missing:
        raise BuildError(f"upstream.lock [requires] names {sorted(missing)}, which upstream "
                         f"METADATA does not require", EXIT_LOCK)
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


def build_wheel(lock: dict, platform: str, out_dir: Path) -> Path:
    t0 = time.monotonic()
    up = lock["upstream"]
    wheel = fetch_wheel(lock, platform)
    files = check_overlay(lock, wheel)
    byte_compile(files)
    version = f"{up['version']}+{up['label']}.{overlay_digest(LOCK.read_bytes(), files)}"
    old_info = f"{up['package']}-{up['version']}.dist-info/"
    new_info = f"{up['package']}-{version}.dist-info/"
    requires = {re.sub(r"[-_.]+", "-", k).lower(): v for k, v in lock["requires"].items()}
    out_name = wheel.name.replace(f"-{up['version']}-", f"-{version}-", 1)
    date_time = zip_time()

    replaced: dict[str, bytes] = {rel: path.read_bytes() for rel, path in files.items()}
    with zipfile.ZipFile(wheel) as src:
        infos = {i.filename: i for i in src.infolist()}
        if "vllm/_version.py" not in infos or old_info + "RECORD" not in infos:
            raise BuildError(f"{wheel.name} lacks vllm/_version.py or its RECORD", EXIT_LOCK)
        replaced["vllm/_version.py"] = version_module(src.read("vllm/_version.py").decode(),
                                                      version)
        record = {row[0]: row for row in csv.reader(io.StringIO(
            src.read(old_info + "RECORD").decode())) if row}
        meta = {old_info + n: src.read(old_info + n).decode() for n in ("METADATA", "WHEEL")}
        meta[old_info + "METADATA"] = rewrite_metadata(meta[old_info + "METADATA"], version,
                                                       requires)

        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".building-", suffix=".whl", dir=out_dir)
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
                                   and not n.endswith("RECORD")):
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
    # dist/ holds one build per platform: older overlay wheels of this pin would shadow it.
    stem, tail = f"{up['package']}-{up['version']}+{up['label']}.", out_name.split("-", 2)[2]
    for stale in out_dir.glob(f"{stem}*-{tail}"):
        if stale.name != out_name:
            stale.unlink()
            log(f"[wheel] removed older build {stale.name}", 2)
    log(f"[wheel] {target} ({version}, {len(files)} overlay files, "
        f"{time.monotonic() - t0:.1f} s)")
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
    files = check_overlay(lock, fetch_wheel(lock, args.platform))
    byte_compile(files)
    new = sum(1 for r in files if lock["overlay"][r].get("new") is True)
    log(f"[check] ok: {len(files) - new} replaced and {new} new overlay files")
    return 0


def cmd_diff(args) -> int:
    lock = load_lock()
    wheel = fetch_wheel(lock, args.platform)
    wanted = {p.removeprefix("vllm_overlay/") for p in args.paths}
    with zipfile.ZipFile(wheel) as zf:
        for rel, entry in sorted(lock["overlay"].items()):
            if entry.get("new") is True or (wanted and rel not in wanted):
                continue
            base = zf.read(rel).decode().splitlines(keepends=True)
            ours = (OVERLAY / rel).read_text().splitlines(keepends=True)
            sys.stdout.writelines(difflib.unified_diff(base, ours, f"a/{rel}", f"b/{rel}"))
    return 0


def cmd_sdist(args) -> int:
    print(fetch_sdist(load_lock()))
    return 0


def cmd_wheel(args) -> int:
    print(build_wheel(load_lock(), args.platform, Path(args.out).resolve()))
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
        return rebase.rebase(args.check, False, True, report)
    return rebase.rebase(args.to, args.allow_conflicts, False, report)


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
    p = sub.add_parser("sdist", parents=[common], help="fetch the pinned sdist, print its path")
    p.set_defaults(func=cmd_sdist)
    p = sub.add_parser("bundle", parents=[common], help="offline install bundle")
    p.add_argument("--wheel", required=True, help="the wheel to bundle (e.g. dist/vllm-*.whl)")
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


if __name__ == "__main__":
    sys.exit(main())
