#!/usr/bin/env python3
"""Build the GLM-5 overlay of vLLM: the pinned upstream wheels with the files of vllm_overlay/ copied in.

Two upstreams are pinned in upstream.lock: vLLM ([upstream]) and vLLM's GGUF support,
vllm-gguf-plugin ([plugin]). Overlay files live under vllm_overlay/<package>/ by their path in
that upstream's wheel. Both wheels get the version <upstream version>+<label>.<overlay digest>
and require each other exactly. The lock, the package index and the cache are tools/upstream.py;
bundle and rebase are tools/bundle.py and tools/rebase.py.

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
import os
import py_compile
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from tools import bundle, rebase
from tools.common import (EXIT_LOCK, BuildError, copy_raw, dist_name, entry_info, log,
                          normalized_name, remove_stale_temps, set_verbosity)
from tools.upstream import (DEFAULT_PLATFORM, LOCK, OVERLAY, ROOT, fetch_sdist, fetch_wheels,
                            load_lock, module_name, overlay_files, pin_of, pins)

MARKER = "# overlay:"
# 1980-01-01, the earliest time a zip entry can carry; SOURCE_DATE_EPOCH overrides it.
ZIP_EPOCH = 315532800


# ---------------------------------------------------------------------------------------------
# Check the overlay against the lock and the upstream wheels
# ---------------------------------------------------------------------------------------------
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
# Write the overlay wheels
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
    return normalized_name(name)


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
    exact = {normalized_name(lock[k]["package"]):
             f"{lock[k]['package']}=={overlay_version(lock, k, digest)}" for k in pins(lock)}
    built = []
    for key in pins(lock):
        own = normalized_name(lock[key]["package"])
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
    requires = {normalized_name(k): v for k, v in requires.items()}
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
    key = next((k for k in pins(lock)
                if normalized_name(lock[k]["package"]) == normalized_name(args.package)), None)
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


def cmd_bundle(args) -> int:
    return bundle.bundle(args.wheel, exclude_from=args.exclude_from, out=args.out,
                         max_part=args.max_part, python_version=args.python_version,
                         platforms=args.platform, only=args.only, drop=args.drop)


def cmd_rebase(args) -> int:
    report = Path(args.report) if args.report else None
    if args.resume or args.abort:
        return rebase.resume(abort=args.abort)
    if args.check:
        return rebase.rebase(args.check, package=args.package, dry_run=True, report_path=report)
    return rebase.rebase(args.to, package=args.package, allow_conflicts=args.allow_conflicts,
                         report_path=report)


def main(argv: list[str] | None = None) -> int:
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
    set_verbosity(0 if args.quiet else 2 if args.verbose else 1)
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
