"""What build.py and its commands in tools/ share: errors and exit codes, logging, file
writes, package names, zip entries."""
from __future__ import annotations

import hashlib
import os
import re
import sys
import zipfile
from pathlib import Path

EXIT_DOWNLOAD, EXIT_HASH, EXIT_LOCK, EXIT_BUNDLE, EXIT_REBASE = 3, 4, 5, 6, 7
VERBOSITY = 1


class BuildError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def set_verbosity(level: int) -> None:
    """0: errors only, 1: progress, 2: detail (build.py's -q and -v)."""
    global VERBOSITY
    VERBOSITY = level


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


def normalized_name(name: str) -> str:
    """A project name as PEP 503 compares it: lower case, runs of -_. become one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_name(package: str) -> str:
    """The package's name in wheel and dist-info names (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", package)


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
