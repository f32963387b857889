# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The files of a GGUF model: split sets, the directory of one model, a quant's
files among a repo's or a folder's.

llama.cpp's `gguf-split` writes a model as `<name>-NNNNN-of-MMMMM.gguf`, the
metadata in the first part (`split.no`/`split.count` in every part,
`split.tensors.count` in the first). A projector (`mmproj*.gguf`) next to a
model is not one of its files.
"""

import os
from pathlib import Path

import regex as re

from .reader import GGUFError, field, open_gguf

SPLIT_RE = re.compile(r"-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # gguf-split


def is_model_file(name: str) -> bool:
    """Whether file `name` (a path or a file name) can be (part of) a GGUF model."""
    base = name.rsplit("/", 1)[-1]
    return base.endswith(".gguf") and not base.startswith("mmproj")


def resolve_gguf_dir(model: str) -> str:
    """A directory that holds one GGUF model (single file or one split set) is
    that model's first file; anything else is returned unchanged."""
    p = Path(model)
    if not p.is_dir() or (p / "config.json").exists():
        return model
    ggufs = sorted(f for f in p.glob("*.gguf") if is_model_file(f.name))
    if not ggufs:
        return model
    firsts = [f for f in ggufs if (m := SPLIT_RE.search(f.name)) is None or int(m["no"]) == 1]
    if len(firsts) != 1:
        raise GGUFError(
            f"{p}: holds {len(firsts)} GGUF models "
            f"({', '.join(f.name for f in firsts)}); pass one file"
        )
    return str(firsts[0])


def _part_paths(path: Path) -> list[Path]:
    """The file names of the model `path` belongs to, by its name alone."""
    m = SPLIT_RE.search(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise GGUFError(f"{path}: the file name says part {int(m['no'])} of {count}, "
                        "which no split set has")
    prefix = path.name[:m.start()]
    return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def split_files(path: str | os.PathLike) -> list[Path]:
    """All files of the GGUF model that `path` belongs to, first part first.

    A single file is returned alone. For a split set (`-NNNNN-of-MMMMM.gguf`,
    any part may be given) every part must exist and carry matching
    `split.no`/`split.count` metadata, the parts must hold different tensors, and
    together the `split.tensors.count` tensors the first part announces.
    """
    path = Path(path)
    if SPLIT_RE.search(path.name) is None:
        return [path]
    parts = _part_paths(path)
    count = len(parts)
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(
            f"split GGUF {parts[0].name}: {len(missing)} of {count} parts missing "
            f"in {path.parent}: {', '.join(missing)}"
        )
    n_tensors = 0
    total = None
    names: dict[str, Path] = {}
    for i, p in enumerate(parts):
        reader = open_gguf(p)
        no = field(reader, "split.no", -1, required=False, kind=int, lo=0)
        cnt = field(reader, "split.count", -1, required=False, kind=int, lo=1)
        if (no, cnt) != (i, count):
            raise GGUFError(
                f"{p}: split metadata says part {no + 1} of {cnt}, "
                f"the file name says part {i + 1} of {count}"
            )
        if i == 0:
            total = field(reader, "split.tensors.count", kind=int, lo=0)
        for t in reader.tensors:
            if (other := names.setdefault(t.name, p)) != p:
                raise GGUFError(f"{p}: tensor {t.name!r} is also in {other.name}; the parts "
                                "of a split set hold different tensors")
        n_tensors += len(reader.tensors)
    if n_tensors != total:
        raise GGUFError(
            f"split GGUF {parts[0].name}: the parts hold {n_tensors} tensors, "
            f"the first part announces {total}"
        )
    return parts


def first_file(path: str | os.PathLike) -> Path:
    """The part holding the metadata; the loader checks the whole set
    (`split_files`), so config and tokenizer open this part only."""
    return _part_paths(Path(path))[0]


def quant_files(names: list[str], quant_type: str, where: str) -> list[str]:
    """The files (relative paths, first part first) of the one GGUF model among
    `names` whose file name ends in `quant_type` (before `.gguf` or the split
    suffix), split parts in any folder (unsloth puts large quants in a folder per
    quant), all parts or none; two models for one name (GLM-5-Q4_K_M and
    GLM-5-UD-Q4_K_M for Q4_K_M) are an error instead of a guess."""
    models: dict[tuple[str, str], list[str]] = {}
    for name in names:
        if not is_model_file(name):
            continue
        base = name.rsplit("/", 1)[-1]
        m = SPLIT_RE.search(base)
        stem = base[: m.start()] if m else base[: -len(".gguf")]
        before = stem[: len(stem) - len(quant_type)]
        if not stem.lower().endswith(quant_type.lower()) or before[-1:] not in ("", "-", "."):
            continue
        key = (name[: len(name) - len(base)], stem + ("-of-" + m["count"] if m else ""))
        models.setdefault(key, []).append(name)
    if not models:
        raise ValueError(f"No GGUF file of quant type {quant_type!r} in {where}")
    if len(models) > 1:
        found = ", ".join(sorted(f"{d}{k.split('-of-')[0]} ({len(v)} files)"
                                 for (d, k), v in models.items()))
        raise ValueError(f"{where} holds {len(models)} GGUF models for quant type "
                         f"{quant_type!r}: {found}; name one by its full quant type")
    files = sorted(next(iter(models.values())))
    if m := SPLIT_RE.search(files[0]):
        count = int(m["count"])
        numbers = sorted(int(SPLIT_RE.search(f)["no"]) for f in files)
        if numbers != list(range(1, count + 1)):
            missing = sorted(set(range(1, count + 1)) - set(numbers))
            raise ValueError(f"{where}: the {quant_type} GGUF split set lacks parts "
                             f"{', '.join(map(str, missing))} of {count}")
    return files
