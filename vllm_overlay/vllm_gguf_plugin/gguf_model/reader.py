# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The structure of a GGUF file, checked before anything reads it.

`gguf.GGUFReader` trusts the counts and offsets a file states: an array count
of 10**7 makes it allocate and loop for a minute, 2**62 never ends, and tensor
offsets that overlap, leave the file or wrap around give garbage weights
without an error. GGUF files are downloaded by the hundred gigabytes, in parts,
from strangers: this walks the header once, bounding every count, length and
offset by the bytes the file has, and checks the tensor table the way
llama.cpp's loader does (`ggml/src/gguf.cpp`):

- every key and string is inside the file, keys are UTF-8 and unique;
- every array's elements fit in what is left of the file;
- every tensor name is unique, has 1 to 4 dimensions, a type whose block size
  divides its first dimension, an offset aligned to `general.alignment` (32 by
  default) and data inside the file; as in llama.cpp, each tensor's data
  follows the previous one's in table order (padded to the alignment);
- the data section ends where the last tensor does (up to the alignment), so a
  stated tensor count that is off shifts nothing silently (stricter than
  llama.cpp, which ignores bytes after the last tensor; every GGUF writer pads
  the last tensor like the others).

`GGUFFile(path)` does that and then serves the metadata and the tensors the way
gguf-py's reader does (`fields[key].contents()`, `get_field(key)`, `tensors[i].data`
as views of the file), from that one bounded pass; it raises `GGUFError` naming the
file, where in it, and what was found. `open_gguf` is how the plugin opens every
GGUF, whatever its architecture (once while the file is unchanged); `field` and
`check_value` read metadata values checked for type and range.
(gguf-py's reader takes about 15 s for a GLM-5 vocabulary's metadata on 2 cores,
this under 1 s.)
"""

import math
import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4

# gguf value types (gguf.constants.GGUFValueType): struct code of each scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be used as it is; the message names the problem."""


class _Cursor:
    """Reads little-endian values from the file, never past its end."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def fail(self, what: str):
        raise GGUFError(f"{self.path}: {what} (at byte {self.pos} of {len(self.data)})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.data):
            self.fail(f"{what} needs {n} bytes, the file has {len(self.data) - self.pos} left")

    def scalar(self, code: str, what: str):
        size = struct.calcsize("<" + code)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + code, self.data, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> bytes:
        n = self.scalar("Q", f"the length of {what}")
        self.need(n, what)
        value = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return value

    def text(self, what: str) -> str:
        """A string that must be UTF-8 (a key, a tensor name)."""
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8 ({raw[:40]!r})")

    def value(self, vtype: int, what: str, depth: int = 0):
        """Read one value of `vtype`, checking that it fits: a Python scalar, bytes
        for a string, (element type, numpy array or list of bytes) for an array."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            self.fail(f"{what} has value type {vtype}, not a GGUF type")
        if depth > 0:
            self.fail(f"{what} is an array of arrays")
        etype = self.scalar("I", f"the element type of {what}")
        count = self.scalar("Q", f"the count of {what}")
        if etype in _SCALARS:
            size = struct.calcsize("<" + _SCALARS[etype])
            if count > (len(self.data) - self.pos) // size:
                self.fail(f"{what} states {count} elements of {size} bytes, more than the "
                          f"file has left")
            values = np.frombuffer(self.data, dtype="<" + _SCALARS[etype], count=count,
                                   offset=self.pos)
            self.pos += count * size
            return etype, values
        if etype == _STRING:
            if count > (len(self.data) - self.pos) // 8:
                self.fail(f"{what} states {count} strings, more than the file has bytes "
                          f"left for their lengths")
            return etype, [self.string(f"{what}[{i}]") for i in range(count)]
        self.fail(f"{what} has element type {etype}, not a GGUF scalar or string")


class Field:
    """A metadata entry: `contents()` as gguf-py's ReaderField gives it (strings
    decoded, arrays as lists), `types` its GGUF value types."""

    def __init__(self, name: str, vtype: int, value, path: Path):
        from gguf import GGUFValueType

        self.name, self._value, self._path = name, value, path
        self.types = [GGUFValueType(vtype)] + (
            [GGUFValueType(value[0])] if vtype == _ARRAY else [])

    def _text(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self._path}: metadata {self.name!r} is not UTF-8 text "
                            f"({raw[:40]!r})") from e

    def contents(self):
        value = self._value
        if isinstance(value, bytes):
            return self._text(value)
        if isinstance(value, tuple):
            etype, values = value
            if etype == _STRING:
                return [self._text(v) for v in values]
            return values.tolist()
        return value


class Tensor(NamedTuple):
    """A tensor as gguf-py's ReaderTensor has it (`data`: a read-only view of the file)."""

    name: str
    tensor_type: "GGMLQuantizationType"  # noqa: F821
    shape: np.ndarray  # GGUF order (innermost first)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


# numpy element types of gguf-py's ReaderTensor.data; other types are bytes
_ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFFile:
    """A GGUF file checked as the module docstring says, then readable the way the
    plugin reads gguf-py's GGUFReader (`fields`, `get_field`, `tensors`,
    `byte_order`, `data`) without trusting anything it states: the header is
    parsed once, bounded."""

    byte_order = "I"  # little-endian; big-endian files are refused

    def __init__(self, path: str | os.PathLike):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        path = Path(path)
        self.path = path
        try:
            size = path.stat().st_size
        except OSError as e:
            raise GGUFError(f"{path}: cannot read ({e})") from e
        if size < 24:
            raise GGUFError(f"{path}: {size} bytes, too short for a GGUF header")
        self.data = data = np.memmap(path, dtype=np.uint8, mode="r")
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        c = _Cursor(memoryview(data), path)
        if bytes(data[:4]) != GGUF_MAGIC:
            c.fail(f"starts with {bytes(data[:4])!r}, not the GGUF magic")
        c.pos = 4
        version = c.scalar("I", "the version")
        if version & 0xFFFF == 0 and version:
            c.fail("is a big-endian GGUF file, which is not supported")
        if version not in (2, 3):
            c.fail(f"has GGUF version {version}; versions 2 and 3 are supported")
        n_tensors = c.scalar("Q", "the tensor count")
        n_kv = c.scalar("Q", "the metadata count")
        # the smallest key-value pair: an empty key (8), a type (4), a uint8 (1)
        if n_kv > (size - c.pos) // 13:
            c.fail(f"states {n_kv} metadata entries, more than its size allows")
        alignment = GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = c.text(f"metadata key {i}")
            if key in self.fields:
                c.fail(f"metadata key {key!r} appears twice")
            vtype = c.scalar("I", f"the type of {key!r}")
            value = c.value(vtype, f"metadata {key!r}")
            self.fields[key] = Field(key, vtype, value, path)
            if key == "general.alignment":
                if vtype != 4:
                    c.fail(f"general.alignment has value type {vtype}, not uint32")
                alignment = value
                if alignment == 0 or alignment & (alignment - 1):
                    c.fail(f"general.alignment is {alignment}, not a power of two")
        # the smallest tensor info: an empty name (8), 1 dim (4 + 8), type (4), offset (8)
        if n_tensors > (size - c.pos) // 32:
            c.fail(f"states {n_tensors} tensors, more than its size allows")
        infos, names = [], set()
        for i in range(n_tensors):
            name = c.text(f"the name of tensor {i}")
            if name in names:
                c.fail(f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = c.scalar("I", f"the dimension count of {name!r}")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                c.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {GGML_MAX_DIMS})")
            dims = [c.scalar("Q", f"dimension {d} of {name!r}") for d in range(n_dims)]
            ttype = c.scalar("I", f"the type of {name!r}")
            offset = c.scalar("Q", f"the offset of {name!r}")
            try:
                qtype = GGMLQuantizationType(ttype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                c.fail(f"tensor {name!r} has type {ttype}, not a GGML type")
            if dims[0] % block:
                c.fail(f"tensor {name!r} ({qtype.name}) has {dims[0]} values a row, not a "
                       f"multiple of its block of {block}")
            elements = 1
            for d in dims:
                elements *= d
            n_bytes = elements // block * type_size
            if n_bytes > size:
                c.fail(f"tensor {name!r} ({qtype.name} {dims}) would take {n_bytes} bytes, "
                       f"more than the file's {size}")
            if offset % alignment:
                c.fail(f"tensor {name!r} has offset {offset}, not aligned to {alignment}")
            infos.append((name, qtype, dims, elements, n_bytes, offset))
        data_start = -(-c.pos // alignment) * alignment
        if any(data[c.pos:min(data_start, size)]):
            c.fail("has bytes other than padding between the tensor table and the data (a "
                   "tensor count lower than the tensors written?)")
        # as llama.cpp (gguf.cpp): each tensor's data follows the previous one's, in table
        # order, padded to the alignment
        expected, end = 0, data_start
        for name, qtype, dims, elements, n_bytes, offset in infos:
            if offset != expected:
                raise GGUFError(f"{path}: tensor {name!r} has data offset {offset}, expected "
                                f"{expected} (after the tensors before it)")
            expected = offset + -(-n_bytes // alignment) * alignment
            end = data_start + offset + n_bytes
            if end > size:
                raise GGUFError(f"{path}: truncated: tensor {name!r} ends at byte {end}, the "
                                f"file has {size}")
            np_dims = tuple(reversed(dims))
            etype = _ELEMENT_TYPES.get(qtype.name)
            view = data[data_start + offset:end]
            view = (view.reshape(quant_shape_to_byte_shape(np_dims, qtype)) if etype is None
                    else view.view(etype).reshape(np_dims))
            self.tensors.append(Tensor(name, qtype, np.array(dims, dtype=np.uint64), elements,
                                       n_bytes, data_start + offset, view))
        # writers pad the last tensor too: more is data no tensor describes
        if size - end >= alignment:
            raise GGUFError(f"{path}: {size - end} bytes after the last tensor's data, more "
                            f"than the padding of {alignment} (a tensor count or offset that "
                            f"does not match the data?)")

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)



def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The GGUF file at `path`, refusing files that are not whole or consistent
    (`GGUFFile`); a file unchanged since it was last opened is not read again."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    stat = path.stat()
    return _open(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


# what a metadata value must be, as it is said in an error
_KINDS = {int: "an integer", float: "a finite number", bool: "a bool", str: "a string"}


def _is(value, kind) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if kind is bool:
        # llama.cpp's converter writes bools; a 0/1 integer reads the same
        return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))
    return isinstance(value, kind)


def check_value(path, key: str, value, kind, lo=None, hi=None, *, above=None):
    """`value` of metadata `key`, if it is of `kind` (int, float, bool, str; a list
    of one: an array of them) and within [lo, hi] (and > above); otherwise a
    GGUFError naming the key, the file, what was found and what was expected."""
    many = isinstance(kind, list)
    item = kind[0] if many else kind
    expected = _KINDS[item] if not many else f"an array of {_KINDS[item].split(' ', 1)[1]}s"
    if above is not None:
        expected += f" above {above:g}"
    if lo is not None and hi is not None:
        expected += f" in {lo}..{hi}"
    elif lo is not None:
        expected += f" >= {lo}"
    elif hi is not None:
        expected += f" <= {hi}"
    values = value if many and isinstance(value, list) else [value]
    ok = (isinstance(value, list) == many and all(
        _is(v, item) and (lo is None or v >= lo) and (hi is None or v <= hi)
        and (above is None or v > above) for v in values))
    if not ok:
        found = repr(value) if not isinstance(value, list) else (
            f"an array of {len(value)}" + (f" ({value[:4]!r}...)" if value else ""))
        raise GGUFError(f"{path}: metadata key {key!r} is {found}, expected {expected}")
    return value


def field(reader: GGUFFile, key: str, default=None, *, required: bool = True, kind=None,
          lo=None, hi=None, above=None):
    """Metadata `key` of a GGUF file (its default when absent and not required),
    checked with `check_value` when `kind` is given."""
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise GGUFError(f"{reader.data.filename}: metadata key {key!r} is missing")
        return default
    value = f.contents()
    if kind is not None:
        check_value(reader.data.filename, key, value, kind, lo, hi, above=above)
    return value
