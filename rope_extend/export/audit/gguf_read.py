"""A GGUF file's metadata and rope tensors, read as a hostile file: every count and length is held against the
bytes the file has left before anything is read or allocated, so a 60-byte file claiming 2^60 array items is
refused at once instead of walked for minutes.

The layout (the GGUF specification in ggml's ``docs/gguf.md``; llama.cpp's ``ggml/src/gguf.cpp`` reads it the same
way): ``GGUF``, a uint32 version (2 or 3; the byte order is the one in which it reads as such), uint64 tensor and
key counts, the keys (a string name, a uint32 value type, the value), the tensor infos (a string name, a uint32
dimension count, uint64 dimensions, a uint32 ggml type, a uint64 offset), then the tensor data from the next
multiple of ``general.alignment`` (32). A string is a uint64 length and its UTF-8 bytes; an array a uint32 item
type, a uint64 count and the items. llama.cpp refuses a duplicate key or tensor name and an array of arrays, and
so does this reader: a file llama.cpp would not load has no rope to audit.

What is kept: every scalar key; numeric arrays up to ``MAX_ARRAY`` items (per-layer values); strings up to
``MAX_STRING`` bytes. Longer values, and every array of strings (the tokenizer's), are walked past and kept as
``Unread``, which every check of a value refuses by name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ...errors import RopeExtendError
from ...untrusted import open_regular

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
TENSOR_TYPES = {0: "f4", 1: "f2"}  # ggml's F32 and F16: the types rope factor tensors are written in
ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
# Each limit is far above what a real file holds and keeps a hostile one to a fraction of a second and a few
# megabytes; the totals stop a file of many keys from adding up what each key alone may hold.
MAX_STRING = 1 << 20  # a kept string value (a chat template is tens of kilobytes)
KEPT_BYTES = 1 << 24  # the string values kept, in all
MAX_NAME = 1 << 10  # a key or tensor name (llama.cpp's tensor names are under 64 bytes, keys some tens)
MAX_ARRAY = 1 << 16  # a kept numeric array (a per-layer value has one item per layer)
KEPT_ITEMS = 1 << 20  # the numeric array items kept, in all
MAX_STRINGS = 1 << 21  # the strings walked past, in all (a tokenizer's vocabulary and merges: under a million)
MAX_KEYS = 1 << 16  # a model has some 50 keys
MAX_TENSORS = 1 << 16  # and some thousands of tensors
MAX_DIMS = 4  # GGML_MAX_DIMS
CHUNK = 1 << 20


@dataclass(frozen=True)
class Unread:
    """A value too long to keep (or an array of strings): its kind and size, for the message that refuses it."""

    kind: str
    size: int

    def __repr__(self) -> str:
        return f"<{self.kind} of {self.size} items, not read>"


class _Source:
    """Bounded reads from an open file of ``size`` bytes, through a buffer of ``CHUNK`` bytes."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size
        self.buf, self.at, self.start = b"", 0, 0  # buf holds the file's bytes from offset start
        self.order: Literal["<", ">"] = "<"  # ">" when only big-endian reads a version (_header)
        self.kept_bytes, self.kept_items, self.strings = KEPT_BYTES, KEPT_ITEMS, MAX_STRINGS  # what is left of each

    @property
    def pos(self) -> int:
        return self.start + self.at

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise RopeExtendError(
                f"the file is cut short: {what} at byte {self.pos} needs {n} bytes, {self.left()} left"
            )
        if self.at + n > len(self.buf):
            self.f.seek(self.pos)
            self.start, self.at = self.pos, 0
            self.buf = self.f.read(max(n, CHUNK))
            if len(self.buf) < n:
                raise RopeExtendError(f"the file changed while it was read (at byte {self.pos})")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise RopeExtendError(
                f"the file is cut short: {what} at byte {self.pos} needs {n} bytes, {self.left()} left"
            )
        self.at += n  # past the buffer's end: the next take refills from the new position

    def seek(self, offset: int, what: str) -> None:
        """Go to byte ``offset`` (tensors need not be stored in the order of their infos)."""
        if offset > self.size:
            raise RopeExtendError(f"{what} starts at byte {offset}, past the end of the file ({self.size} bytes)")
        if self.start <= offset <= self.start + len(self.buf):
            self.at = offset - self.start
        else:
            self.buf, self.at, self.start = b"", 0, offset

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, item_bytes: int, most: int) -> int:
        """A uint64 count of items of at least ``item_bytes`` bytes each: no more than the bytes left allow, nor
        than ``most``."""
        n = self.unpack("Q", what)
        if n * item_bytes > self.left():
            raise RopeExtendError(
                f"{what} claims {n} items of at least {item_bytes} bytes, but the file has {self.left()} bytes left"
            )
        if n > most:
            raise RopeExtendError(f"{what} claims {n} items; the audit reads at most {most}")
        return n

    def skip_strings(self, n: int, what: str) -> None:
        """Walk past ``n`` strings: the loop a GGUF repeats most (a tokenizer's vocabulary and merges, up to a million
        strings), so it reads the lengths from the buffer directly."""
        if n > self.strings:
            raise RopeExtendError(f"{what}: {n} more strings; the audit walks past at most {MAX_STRINGS} in all")
        self.strings -= n
        length_at = struct.Struct(self.order + "Q").unpack_from
        for _ in range(n):
            if self.at + 8 > len(self.buf):
                self.take(8, what)  # refills the buffer from here (or says the file is cut short)
                self.at -= 8
            length = length_at(self.buf, self.at)[0]
            self.at += 8
            if length > self.size - self.start - self.at:
                raise RopeExtendError(f"the file is cut short: {what} at byte {self.pos} claims {length} bytes")
            self.at += length

    def string(self, what: str, most: int) -> str | Unread:
        n = self.count(f"the length of {what}", 1, self.left())
        if n > min(most, self.kept_bytes):
            self.skip(n, what)
            return Unread("string", n)
        self.kept_bytes -= n
        return self.take(n, what).decode("utf-8", "replace")


def _value(src: _Source, vtype: int, key: str) -> Any:
    what = f"the value of {key!r}"
    if vtype in SCALARS:
        return src.unpack(SCALARS[vtype], what)
    if vtype == STRING:
        return src.string(what, MAX_STRING)
    if vtype != ARRAY:
        raise RopeExtendError(f"key {key!r} has value type {vtype}, which GGUF does not define")
    item = src.unpack("I", f"the item type of {key!r}")
    if item == STRING:
        n = src.count(f"array {key!r}", 8, src.left())
        src.skip_strings(n, f"a string in {key!r}")
        return Unread("array of strings", n)
    if item not in SCALARS:
        raise RopeExtendError(f"array {key!r} has item type {item} (llama.cpp reads no arrays of arrays)")
    size = struct.calcsize(SCALARS[item])
    n = src.count(f"array {key!r}", size, src.left())
    if n > min(MAX_ARRAY, src.kept_items):
        src.skip(n * size, what)
        return Unread("array", n)
    src.kept_items -= n
    return list(struct.unpack(f"{src.order}{n}{SCALARS[item]}", src.take(n * size, what)))


def _header(src: _Source) -> tuple[int, int]:
    magic = src.take(4, "the magic") if src.left() >= 4 else b""
    if magic != b"GGUF":
        raise RopeExtendError(f"it starts with {magic!r}, not b'GGUF': not a GGUF file")
    raw = src.take(4, "the version")
    version = struct.unpack("<I", raw)[0]
    if version not in (2, 3) and struct.unpack(">I", raw)[0] in (2, 3):
        src.order, version = ">", struct.unpack(">I", raw)[0]
    if version not in (2, 3):
        raise RopeExtendError(f"GGUF version {version}: llama.cpp reads versions 2 and 3")
    n_tensors = src.count("the tensor count", 24, MAX_TENSORS)  # a name length, dims, type, offset: 24 bytes
    n_keys = src.count("the key count", 13, MAX_KEYS)  # a name length, type, and a value of at least 1 byte
    return n_tensors, n_keys


def read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(keys, rope tensors)`` of a GGUF file: its metadata keys (``Unread`` for what is not kept), and the
    ``rope_freqs`` / ``rope_factors_long`` / ``rope_factors_short`` tensors (also under ``blk.0.``) as float64
    arrays, named without ``blk.0.`` and ``.weight``."""
    with open_regular(path, name=f"the GGUF file {path}") as f:
        size = f.seek(0, 2)
        src = _Source(f, size)
        n_tensors, n_keys = _header(src)
        keys: dict[str, Any] = {}
        for _ in range(n_keys):
            key = src.string("a key name", MAX_NAME)
            if isinstance(key, Unread):
                raise RopeExtendError(f"a key name of {key.size} bytes at byte {src.pos}: not a GGUF key")
            if key in keys:
                raise RopeExtendError(f"key {key!r} appears twice (llama.cpp refuses the file)")
            keys[key] = _value(src, src.unpack("I", f"the type of {key!r}"), key)
        infos = _tensor_infos(src, n_tensors)
        alignment = keys.get("general.alignment", 32)
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment < 1
            or alignment & (alignment - 1)
        ):
            raise RopeExtendError(f"general.alignment must be a power of 2, got {alignment!r}")
        data = -(-src.pos // alignment) * alignment
        tensors = {name: _tensor(src, name, *info, data) for name, info in infos.items()}
    return keys, tensors


def _tensor_infos(src: _Source, n_tensors: int) -> dict[str, tuple[list[int], int, int]]:
    """``{short name: (dims, ggml type, offset)}`` of the rope tensors; the others are walked past."""
    seen: set[str] = set()
    out = {}
    for _ in range(n_tensors):
        name = src.string("a tensor name", MAX_NAME)
        if isinstance(name, Unread) or name in seen:
            raise RopeExtendError(f"tensor name {name!r} at byte {src.pos}: too long or appears twice")
        seen.add(name)
        n_dims = src.unpack("I", f"the dimension count of {name!r}")
        if n_dims > MAX_DIMS:
            raise RopeExtendError(f"tensor {name!r} has {n_dims} dimensions; ggml has at most {MAX_DIMS}")
        dims = [src.unpack("Q", f"a dimension of {name!r}") for _ in range(n_dims)]
        kind = src.unpack("I", f"the type of {name!r}")
        offset = src.unpack("Q", f"the offset of {name!r}")
        short = name.removeprefix("blk.0.").removesuffix(".weight")
        if short in ROPE_TENSORS and (name.split(".")[0] in ROPE_TENSORS or name.startswith("blk.0.")):
            if short in out:
                raise RopeExtendError(f"the rope tensor {short!r} is in the file twice (as {name!r} too)")
            out[short] = (dims, kind, offset)
    return out


def _tensor(src: _Source, name: str, dims: list[int], kind: int, offset: int, data: int) -> np.ndarray:
    """One rope tensor's values as float64, read only after its size and place are checked against the file."""
    count = 1
    for d in dims:
        count *= d
    if kind not in TENSOR_TYPES:
        raise RopeExtendError(f"tensor {name!r} has ggml type {kind}; the audit reads rope tensors in F32 or F16")
    if count > MAX_ARRAY:
        raise RopeExtendError(f"tensor {name!r} claims {count} values; a rope tensor has one per rotated pair")
    dtype = np.dtype(TENSOR_TYPES[kind]).newbyteorder(src.order)
    src.seek(data + offset, f"tensor {name!r}")
    raw = src.take(count * dtype.itemsize, f"tensor {name!r}")
    return np.frombuffer(raw, dtype=dtype).astype(np.float64)
