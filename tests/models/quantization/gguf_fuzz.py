# SPDX-License-Identifier: Apache-2.0
"""Malformed variants of a valid GGUF (glm-dsa, llama), for the hardening tests.

A GGUF is parsed here into its parts (`Gguf`: version, metadata entries with their
GGUF value types, tensor infos, the data section) and written back byte for byte, so
that a variant can change anything: a value's type, an array's stated count, a
tensor's offset, the tensor count. `variants(path, seed)` yields (category,
description, bytes) for the categories of the hardening issue: truncations, bit flips
in the header, edited metadata, edited tensor tables; `split_variants` breaks split
sets. The reader of the code under test is not used to build them.
"""

import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_CODE = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
         U64: "Q", I64: "q", F64: "d"}


@dataclass
class Tensor:
    name: bytes
    dims: list[int]
    type: int
    offset: int


@dataclass
class Gguf:
    version: int
    kv: list[tuple[bytes, int, object]]  # (key, type, value); arrays: (elem type, [values])
    tensors: list[Tensor]
    data: bytes
    alignment: int = 32
    n_tensors: int | None = None  # stated count (None: len(tensors))
    array_counts: dict[bytes, int] = field(default_factory=dict)  # stated counts

    def get(self, key: str):
        return next((v for k, t, v in self.kv if k == key.encode()), None)

    def with_value(self, key: str, vtype: int, value) -> "Gguf":
        kv = [(k, vtype, value) if k == key.encode() else (k, t, v) for k, t, v in self.kv]
        if all(k != key.encode() for k, _, _ in self.kv):
            kv.append((key.encode(), vtype, value))
        return replace(self, kv=kv)

    def without(self, key: str) -> "Gguf":
        return replace(self, kv=[e for e in self.kv if e[0] != key.encode()])


def _read_value(data: bytes, pos: int, vtype: int):
    if vtype in _CODE:
        size = struct.calcsize("<" + _CODE[vtype])
        return struct.unpack_from("<" + _CODE[vtype], data, pos)[0], pos + size
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", data, pos)
        return data[pos + 8:pos + 8 + n], pos + 8 + n
    etype, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    values = []
    for _ in range(count):
        v, pos = _read_value(data, pos, etype)
        values.append(v)
    return (etype, values), pos


def parse(path: Path) -> Gguf:
    data = path.read_bytes()
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos, kv = 24, []
    for _ in range(n_kv):
        key, pos = _read_value(data, pos, STRING)
        (vtype,) = struct.unpack_from("<I", data, pos)
        value, pos = _read_value(data, pos + 4, vtype)
        kv.append((key, vtype, value))
    tensors = []
    for _ in range(n_tensors):
        name, pos = _read_value(data, pos, STRING)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        dims = list(struct.unpack_from(f"<{n_dims}Q", data, pos + 4))
        ttype, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append(Tensor(name, dims, ttype, offset))
    g = Gguf(version, kv, tensors, b"")
    g.alignment = g.get("general.alignment") or 32
    start = -(-pos // g.alignment) * g.alignment
    g.data = data[start:]
    return g


def _write_value(out: bytearray, vtype: int, value, count: int | None = None) -> None:
    if vtype in _CODE:
        out += struct.pack("<" + _CODE[vtype], value)
    elif vtype == STRING:
        value = value if isinstance(value, bytes) else str(value).encode()
        out += struct.pack("<Q", len(value)) + value
    else:
        etype, values = value
        out += struct.pack("<IQ", etype, len(values) if count is None else count)
        for v in values:
            _write_value(out, etype, v)


def write(g: Gguf) -> bytes:
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", g.version,
                       len(g.tensors) if g.n_tensors is None else g.n_tensors, len(g.kv))
    for key, vtype, value in g.kv:
        _write_value(out, STRING, key)
        out += struct.pack("<I", vtype)
        _write_value(out, vtype, value, g.array_counts.get(key))
    for t in g.tensors:
        _write_value(out, STRING, t.name)
        out += struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims)
        out += struct.pack("<IQ", t.type, t.offset)
    out += bytes(-len(out) % g.alignment)
    return bytes(out) + g.data


def header_size(g: Gguf) -> int:
    return len(write(g)) - len(g.data)


def metadata_variants(g: Gguf, rng: random.Random) -> Iterator[tuple[str, Gguf]]:
    A = g.get("general.architecture").decode()  # the keys of its architecture
    n_layers = g.get(f"{A}.block_count")
    n_tokens = len(g.get("tokenizer.ggml.tokens")[1])
    ints = [k.decode() for k, t, _ in g.kv if t in (U32, I32, U64) and k.startswith(f"{A}.".encode())]
    floats = [k.decode() for k, t, _ in g.kv if t == F32]
    # values of the right type that cannot be right
    for key, value in [
        (f"{A}.expert_used_count", 99), (f"{A}.expert_used_count", 0),
        (f"{A}.attention.indexer.top_k", 0), (f"{A}.block_count", 10**8),
        (f"{A}.block_count", 0), (f"{A}.context_length", 0),
        (f"{A}.attention.head_count", 0), (f"{A}.embedding_length", 0),
        (f"{A}.leading_dense_block_count", n_layers + 5), (f"{A}.nextn_predict_layers", 99),
        (f"{A}.attention.kv_lora_rank", 0), (f"{A}.expert_count", 1),
        (f"{A}.attention.indexer.head_count", 0), (f"{A}.expert_shared_count", 0),
        ("tokenizer.ggml.eos_token_id", n_tokens + 7), ("tokenizer.ggml.eos_token_id", 2**32 - 1),
        ("tokenizer.ggml.padding_token_id", n_tokens), ("tokenizer.ggml.bos_token_id", 10**9),
    ]:
        if g.get(key) is not None:
            yield f"{key} = {value}", g.with_value(key, next(t for k, t, _ in g.kv
                                                               if k == key.encode()), value)
    for key in ints:
        yield f"{key} as a string", g.with_value(key, STRING, b"2")
        yield f"{key} = -1 (int32)", g.with_value(key, I32, -1)
    for key in floats:
        for value in (float("nan"), -1.0, 0.0, float("inf")):
            yield f"{key} = {value}", g.with_value(key, F32, value)
        yield f"{key} as a string", g.with_value(key, STRING, b"1e-5")
    yield "index_topk = -1", g.with_value(f"{A}.attention.indexer.top_k", I32, -1)
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre"):
        yield f"{key} not UTF-8", g.with_value(key, STRING, b"glm-\xff\xfe")
        yield f"{key} as an int", g.with_value(key, U32, 7)
    yield "architecture llama", g.with_value("general.architecture", STRING, b"llama")
    for key in (f"{A}.block_count", f"{A}.embedding_length", "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges", f"{A}.attention.indexer.top_k", "tokenizer.ggml.model",
                f"{A}.expert_count", "tokenizer.ggml.eos_token_id", f"{A}.context_length"):
        yield f"{key} missing", g.without(key)
    tokens = g.get("tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type")
    yield "token_type shorter", g.with_value("tokenizer.ggml.token_type", ARRAY,
                                             (types[0], types[1][: n_tokens // 2]))
    yield "more tokens than embedding rows", g.with_value(
        "tokenizer.ggml.tokens", ARRAY, (tokens[0], tokens[1] + [b"extra%d" % i
                                                              for i in range(64)]))
    yield "duplicate tokens", g.with_value("tokenizer.ggml.tokens", ARRAY,
                                           (tokens[0], [tokens[1][0]] * 2 + tokens[1][2:]))
    yield "eos = -1", g.with_value("tokenizer.ggml.eos_token_id", I32, -1)
    yield "merges not strings", g.with_value("tokenizer.ggml.merges", ARRAY, (U32, [1, 2, 3]))
    if (sched := g.get(f"{A}.attention.indexer.types")) is not None:
        yield "indexer schedule shorter", g.with_value(
            f"{A}.attention.indexer.types", ARRAY, (sched[0], sched[1][:-2]))
    else:
        yield "indexer schedule shorter", g.with_value(
            f"{A}.attention.indexer.types", ARRAY, (BOOL, [True] * (n_layers - 2)))
        yield "indexer schedule of strings", g.with_value(
            f"{A}.attention.indexer.types", ARRAY, (STRING, [b"full"] * n_layers))
    # stated array counts beyond the file (the parser must not believe them)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        for count in (10**7, 2**30, 2**62):
            v = replace(g, array_counts={key.encode(): count})
            yield f"{key} states {count} elements", v
    # a string whose stated length runs past the end
    for _ in range(4):
        key = rng.choice([k for k, t, _ in g.kv if t == STRING])
        v = replace(g, kv=list(g.kv))
        v.kv.append((key + b"x", U64, 0))
        yield f"an unknown key {key.decode()!r}x", v
    dup = replace(g, kv=g.kv + [g.kv[0]])
    yield "a key twice", dup


def tensor_variants(g: Gguf, rng: random.Random) -> Iterator[tuple[str, Gguf]]:
    n = len(g.tensors)
    picks = rng.sample(range(n), min(n, 6))

    def edit(i, **kw):
        tensors = list(g.tensors)
        tensors[i] = replace(tensors[i], **kw)
        return replace(g, tensors=tensors)

    for i in picks:
        t = g.tensors[i]
        name = t.name.decode()
        yield f"{name} offset +1", edit(i, offset=t.offset + 1)
        yield f"{name} offset +alignment", edit(i, offset=t.offset + g.alignment)
        yield f"{name} offset past the end", edit(i, offset=len(g.data) * 4)
        yield f"{name} offset 2^64-64", edit(i, offset=2**64 - 64)
        if i:
            yield f"{name} overlaps the previous", edit(i, offset=g.tensors[i - 1].offset)
        yield f"{name} type F32<->F16", edit(i, type={0: 1, 1: 0}.get(t.type, 0))
        yield f"{name} type BF16", edit(i, type=30 if t.type != 30 else 1)
        yield f"{name} type 99", edit(i, type=99)
        yield f"{name} first dim halved", edit(i, dims=[max(1, t.dims[0] // 2)] + t.dims[1:])
        yield f"{name} a dim doubled", edit(i, dims=t.dims[:-1] + [t.dims[-1] * 2])
        yield f"{name} 5 dims", edit(i, dims=t.dims + [1] * (5 - len(t.dims)))
        yield f"{name} renamed", edit(i, name=t.name + b".x")
        yield f"{name} as blk.00", edit(i, name=t.name.replace(b"blk.1.", b"blk.01."))
    yield "a tensor twice", edit(1, name=g.tensors[0].name)
    yield "tensor count -1", replace(g, n_tensors=n - 1)
    yield "tensor count +1", replace(g, n_tensors=n + 1)
    yield "tensor count 2^40", replace(g, n_tensors=2**40)
    yield "last tensor missing", replace(g, tensors=g.tensors[:-1])
    # a required tensor removed with its data, the rest consistent (output.weight is
    # not required: without it the file is a valid model with a tied head)
    for i in [next(i for i, t in enumerate(g.tensors) if t.name.startswith(b"blk.")),
              next(i for i, t in enumerate(g.tensors) if t.name == b"token_embd.weight")]:
        start, end = g.tensors[i].offset, (g.tensors[i + 1].offset if i + 1 < n
                                           else len(g.data))
        yield f"{g.tensors[i].name.decode()} removed with its data", replace(
            g, tensors=g.tensors[:i] + [replace(t, offset=t.offset - (end - start))
                                        for t in g.tensors[i + 1:]],
            data=g.data[:start] + g.data[end:])


def variants(path: Path, seed: int = 0) -> Iterator[tuple[str, str, bytes]]:
    rng = random.Random(seed)
    g = parse(path)
    raw = path.read_bytes()
    assert write(g) == raw, "the test's GGUF writer does not reproduce the file"
    head = header_size(g)
    for cut in sorted({0, 3, 4, 23, 24, head - 1, head, head + 1, len(raw) - 1}
                      | {rng.randrange(len(raw)) for _ in range(40)}
                      | {rng.randrange(head) for _ in range(30)}):
        yield "truncation", f"first {cut} bytes", raw[:cut]
    for _ in range(100):
        pos, bit = rng.randrange(head), rng.randrange(8)
        flipped = bytearray(raw)
        flipped[pos] ^= 1 << bit
        yield "bit flip", f"byte {pos} bit {bit}", bytes(flipped)
    for what, v in metadata_variants(g, rng):
        yield "metadata", what, write(v)
    for what, v in tensor_variants(g, rng):
        yield "tensor table", what, write(v)


def split(g: Gguf, n_parts: int) -> list[Gguf]:
    """`g` as a split set of `n_parts` (gguf-split's layout: the metadata in the first
    part, `split.no`/`split.count`/`split.tensors.count` in every part)."""
    n = len(g.tensors)
    bounds = [round(i * n / n_parts) for i in range(n_parts + 1)]
    parts = []
    for no in range(n_parts):
        tensors = g.tensors[bounds[no]:bounds[no + 1]]
        start = tensors[0].offset
        end = g.tensors[bounds[no + 1]].offset if bounds[no + 1] < n else len(g.data)
        kv = (list(g.kv) if no == 0 else
              [e for e in g.kv if e[0] in (b"general.architecture", b"general.alignment")])
        kv += [(b"split.no", U16, no), (b"split.count", U16, n_parts),
               (b"split.tensors.count", I32, n)]
        parts.append(Gguf(g.version, kv, [replace(t, offset=t.offset - start) for t in tensors],
                          g.data[start:end], g.alignment))
    return parts


def split_variants(path: Path, prefix: str) -> Iterator[tuple[str, dict[str, bytes], str]]:
    """(description, {file name: bytes}, the name to load) of split sets of the GGUF at
    `path`: a valid one of 2 and of 3 parts (named by its first and by its last part),
    then broken ones."""
    g = parse(path)

    def name(no, count):
        return f"{prefix}-{no:05d}-of-{count:05d}.gguf"

    def files(parts, count=None):
        count = count or len(parts)
        return {name(i + 1, count): write(p) for i, p in enumerate(parts)}

    two, three = split(g, 2), split(g, 3)
    yield "2 parts", files(two), name(1, 2)
    yield "3 parts, named by the last", files(three), name(3, 3)
    yield "part 2 of 3 missing", {k: v for k, v in files(three).items()
                                  if k != name(2, 3)}, name(1, 3)
    yield "named -00001-of-00000", {name(1, 0): write(two[0])}, name(1, 0)
    yield "named -00003-of-00002", files(two) | {name(3, 2): write(two[1])}, name(3, 2)
    yield "parts swapped", {name(1, 2): write(two[1]), name(2, 2): write(two[0])}, name(1, 2)
    wrong_count = [p.with_value("split.count", U16, 3) for p in two]
    yield "split.count 3 in a set of 2", files(wrong_count, 2), name(1, 2)
    yield "split.no as a string", files([two[0].with_value("split.no", STRING, b"0"),
                                         two[1]]), name(1, 2)
    yield "split.tensors.count one less", files([two[0].with_value(
        "split.tensors.count", I32, len(g.tensors) - 1), two[1]]), name(1, 2)
    dup = replace(two[1], tensors=[replace(two[1].tensors[0], name=two[0].tensors[-1].name)]
                  + two[1].tensors[1:])
    yield "a tensor in both parts", files([two[0], dup]), name(1, 2)
    yield "part 2 truncated", files([two[0]], 2) | {name(2, 2): write(two[1])[:-100]}, name(1, 2)
    yield "part 2 of a single file", files([two[0]], 2) | {name(2, 2): write(g)}, name(1, 2)
