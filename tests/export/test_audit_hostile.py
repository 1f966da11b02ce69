"""``rope-extend audit`` on damaged and hostile files (issue 63): every value a file gives is checked before the
audit computes with it, every count and length is held against the bytes the file has, and each case ends in
one line on stderr with exit 2 (or the right verdict), quickly, with every file as it was.

The GGUF files are written here: the value cases with gguf's own writer (which writes any type under any key),
the structural ones (a length field that lies, a file cut short) byte by byte.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time

import numpy as np
import pytest

from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.export.audit.rope import Rope, close, differences

gguf = pytest.importorskip("gguf")
T = gguf.GGUFValueType
FAST = 2.0  # seconds: the 60-byte file claiming 2^60 items was walked for minutes
BASE = {
    "context_length": (T.UINT32, 1024),
    "block_count": (T.UINT32, 2),
    "embedding_length": (T.UINT32, 64),
    "attention.head_count": (T.UINT32, 4),
    "rope.dimension_count": (T.UINT32, 16),
    "rope.freq_base": (T.FLOAT32, 10000.0),
}


def planted(path, tensors=None, **keys):
    """A llama GGUF with ``BASE``'s keys, ``keys`` (``rope__scaling__factor=(type, value)``, None to drop one)
    put in or over them, and ``tensors``."""
    w = gguf.GGUFWriter(path, "llama")
    merged = {**BASE, **{k.replace("__", "."): v for k, v in keys.items()}}
    for name, value in merged.items():
        if value is None:
            continue
        if value[0] == T.ARRAY:
            w.add_array(f"llama.{name}", value[1])
        else:
            w.add_key_value(f"llama.{name}", value[1], value[0])
    for name, array in (tensors or {}).items():
        w.add_tensor(name, np.asarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def raw(path, body: bytes, n_tensors: int = 0, n_keys: int = 1):
    """A GGUF v3 header claiming ``n_tensors`` tensors and ``n_keys`` keys, then ``body`` as it is."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_keys) + body)
    return path


def snapshot(folder):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, tmp_path, *args):
    """Run ``audit ARGS``: exit 2, one ``error:`` line and no traceback, within ``FAST`` seconds, nothing changed;
    returns the line."""
    before = snapshot(tmp_path)
    capsys.readouterr()
    start = time.monotonic()
    code = main(["audit", *map(str, args)])
    took = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rope-extend: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert took < FAST, (took, lines)
    assert snapshot(tmp_path) == before
    return lines[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A transformers config whose rope is linear x2: what the planted GGUFs claim to serve."""
    from tests.tiny import tiny_config

    folder = tmp_path_factory.mktemp("ref")
    config = tiny_config("llama").to_dict()
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", autouse=True)
def warm(reference):
    """One audit before the timed ones, so that they time the audit and not the first import of transformers'
    config classes."""
    assert main(["audit", str(reference)]) == 0


# ------------------------------------------------------------------------------------- the NaN comparison
@pytest.mark.parametrize(
    ("factor", "said"),
    [
        (math.nan, "must be a finite number, got nan"),
        (math.inf, "must be a finite number, got inf"),
        (-math.inf, "must be a finite number, got -inf"),
        (-2.0, "must be >= 0.0, got -2.0"),
    ],
)
@pytest.mark.parametrize("with_reference", [True, False])
def test_a_factor_that_is_not_a_number_is_refused(tmp_path, capsys, reference, factor, said, with_reference):
    """A NaN factor once passed the comparison with the reference as "equal" (exit 0), and without a reference
    nothing was said: now it is refused by name, before anything is computed with it."""
    f = planted(
        tmp_path / "m.gguf", rope__scaling__type=(T.STRING, "linear"), rope__scaling__factor=(T.FLOAT32, factor)
    )
    line = refused(capsys, tmp_path, f, *(["--reference", reference] if with_reference else []))
    assert f"llama.rope.scaling.factor {said}" in line, line


def test_the_same_file_with_a_finite_factor_is_compared(tmp_path, capsys, reference):
    """The planted files differ from one the audit passes in the factor alone."""
    f = planted(tmp_path / "m.gguf", rope__scaling__type=(T.STRING, "linear"), rope__scaling__factor=(T.FLOAT32, 2.0))
    assert main(["audit", str(f), "--reference", str(reference)]) == 0
    f = planted(tmp_path / "m.gguf", rope__scaling__type=(T.STRING, "linear"), rope__scaling__factor=(T.FLOAT32, 3.0))
    assert main(["audit", str(f), "--reference", str(reference)]) == 1


def test_a_comparison_never_calls_a_nan_equal():
    """``differences`` asks whether values are close, so a value that compares false with everything (NaN) or an
    infinity is a difference, never "not unequal"; a ``Rope`` refuses to hold one at all."""
    want = Rope(np.array([1.0, 0.5, 0.0]), 1.0, "reference")
    got = Rope(np.array([1.0, 0.5, 0.0]), 1.0, "engine")
    assert differences(got, want) == []  # two zeros (a frequency that never rotates) are close
    object.__setattr__(got, "freqs", np.array([1.0, math.nan, 0.0]))  # past the Rope's own check
    assert "1 of 3 frequencies differ" in differences(got, want)[0]
    object.__setattr__(got, "freqs", np.array([1.0, 0.5, math.inf]))
    assert "1 of 3 frequencies differ" in differences(got, want)[0]
    object.__setattr__(got, "freqs", want.freqs)
    object.__setattr__(got, "scale", math.nan)
    assert differences(got, want) == ["cos/sin scale nan vs 1"]
    assert not close(math.nan, math.nan, 1e-4) and not close(math.inf, math.inf, 1e-4) and close(0.0, 0.0, 1e-4)
    for freqs, scale in (([1.0, math.nan], 1.0), ([1.0, -0.5], 1.0), ([1.0, 0.5], math.nan), ([1.0], 0.0)):
        with pytest.raises(RopeExtendError, match="not a rope the audit can compare"):
            Rope(np.array(freqs), scale, "planted")


# ------------------------------------------------------------------------------ GGUF keys of the wrong kind
BAD_KEYS = {
    "a string block count": ({"block_count": (T.STRING, "2")}, "llama.block_count must be an integer >= 1, got '2'"),
    "a float block count": ({"block_count": (T.FLOAT32, 2.0)}, "llama.block_count must be an integer >= 1, got 2.0"),
    "billions of layers": ({"block_count": (T.UINT32, 4_000_000_000)}, "the audit reads models of at most 65536"),
    "an odd rotary dimension": ({"rope.dimension_count": (T.UINT32, 15)}, "-> 15 must be an even integer >= 2"),
    "a huge rotary dimension": ({"rope.dimension_count": (T.UINT32, 1 << 30)}, "the audit reads at most 65536"),
    "a zero base": ({"rope.freq_base": (T.FLOAT32, 0.0)}, "llama.rope.freq_base: base (rope_theta) must be > 1.0"),
    "a NaN base": ({"rope.freq_base": (T.FLOAT32, math.nan)}, "llama.rope.freq_base must be a finite number, got nan"),
    "an integer base": ({"rope.freq_base": (T.UINT32, 10000)}, "llama.rope.freq_base must be a float (llama.cpp"),
    "a zero attn_factor": ({"rope.scaling.attn_factor": (T.FLOAT32, 0.0)}, "attn_factor must be > 0.0, got 0.0"),
    "a scaling type that is a number": ({"rope.scaling.type": (T.UINT32, 2)}, "rope.scaling.type int 2"),
    "a negative log multiplier": (
        {"rope.scaling.type": (T.STRING, "yarn"), "rope.scaling.yarn_log_multiplier": (T.FLOAT32, -1.0)},
        "yarn_log_multiplier must be >= 0.0",
    ),
    "yarn with no length at all": (
        {"rope.scaling.type": (T.STRING, "yarn"), "context_length": None},
        "YaRN needs an original length",
    ),
    "per-layer heads of the wrong length": (
        {"attention.head_count": (T.ARRAY, [4, 4, 4])},
        "attention.head_count must have one item per layer (2), got an array of 3 items",
    ),
}


@pytest.mark.parametrize("name", list(BAD_KEYS))
def test_gguf_keys_of_the_wrong_type_or_range(tmp_path, capsys, name):
    keys, said = BAD_KEYS[name]
    f = planted(tmp_path / "m.gguf", **{k.replace(".", "__"): v for k, v in keys.items()})
    line = refused(capsys, tmp_path, f)
    assert said in line and str(f) in line, line


def test_a_sliding_window_pattern_shorter_than_the_model(tmp_path, capsys):
    f = planted(
        tmp_path / "m.gguf", block_count=(T.UINT32, 4), attention__sliding_window_pattern=(T.ARRAY, [True, False])
    )
    assert "sliding_window_pattern must have one item per layer (4)" in refused(capsys, tmp_path, f)


@pytest.mark.parametrize(("values", "said"), [([1.0, math.nan] * 4, "holds nan at index 1"), ([0.0] * 8, "holds 0.0")])
def test_a_rope_tensor_with_a_nan_or_a_zero(tmp_path, capsys, values, said):
    f = planted(tmp_path / "m.gguf", tensors={"rope_freqs.weight": values})
    line = refused(capsys, tmp_path, f)
    assert f"rope_freqs tensor {said}" in line and "must be a finite number > 0" in line, line


# ------------------------------------------------------------------------------ GGUF structures that lie
@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_the_bounded_reader_reads_what_gguf_reads(tmp_path, endian):
    """The audit's reader against gguf's own GGUFReader on a file with a key of every type, an array of strings,
    rope tensors in F32 and F16 (and one that is not a rope tensor), in both byte orders."""
    from rope_extend.export.audit import gguf_read

    f = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(f, "llama", endianess=getattr(gguf.GGUFEndian, endian))
    scalars = [T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.FLOAT32, T.UINT64, T.INT64, T.FLOAT64]
    for i, vtype in enumerate(scalars):
        w.add_key_value(f"k.{vtype.name}", 1.5 if "FLOAT" in vtype.name else i + 1, vtype)
    w.add_bool("k.bool", True)
    w.add_string("k.string", "héllo")
    w.add_array("k.ints", [3, 1, 4])
    w.add_array("k.floats", [0.5, 2.5])
    w.add_array("k.strings", ["a", "bc", ""])
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.add_tensor("rope_factors_long.weight", np.linspace(1, 2, 8, dtype=np.float32))
    w.add_tensor("blk.0.rope_factors_short.weight", np.linspace(1, 1.5, 8).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    keys, tensors = gguf_read.read(f)
    theirs = gguf.GGUFReader(f)
    for field in theirs.fields.values():
        if field.name.startswith("GGUF."):  # the reader's own header fields
            continue
        if field.types[0] == T.ARRAY and field.types[1] == T.STRING:
            assert keys[field.name] == gguf_read.Unread("array of strings", len(field.data))
        elif field.types[0] == T.ARRAY:
            assert keys[field.name] == [field.parts[i].tolist()[0] for i in field.data], field.name
        elif field.types[0] == T.STRING:
            assert keys[field.name] == bytes(field.parts[field.data[0]]).decode(), field.name
        else:
            assert keys[field.name] == field.parts[field.data[0]].tolist()[0], field.name
    assert len(keys) == len([name for name in theirs.fields if not name.startswith("GGUF.")]) == 16
    assert sorted(tensors) == ["rope_factors_long", "rope_factors_short"]
    for t in theirs.tensors:
        if "rope" in t.name:
            want = np.asarray(t.data, dtype=np.float64).reshape(-1)
            assert np.array_equal(tensors[t.name.removeprefix("blk.0.").removesuffix(".weight")], want), t.name


def _array_claim(path):
    """The issue's 60-byte file: one key, an array of uint32 whose length field claims 2^60 items."""
    return raw(path, string(b"llama.x") + struct.pack("<IIQ", 9, 4, 1 << 60) + b"\0" * 5)


STRUCTURES = {
    "an array claiming 2^60 items": (_array_claim, "claims 1152921504606846976 items of at least 4 bytes"),
    "a string claiming 2^62 bytes": (
        lambda p: raw(p, string(b"general.name") + struct.pack("<IQ", 8, 1 << 62)),
        "claims 4611686018427387904 items of at least 1 bytes",
    ),
    "a key name claiming 2^40 bytes": (
        lambda p: raw(p, struct.pack("<Q", 1 << 40) + b"\0" * 8),
        "the length of a key name",
    ),
    "a tensor count past the file": (lambda p: raw(p, b"", n_tensors=1 << 40, n_keys=0), "the tensor count claims"),
    "a key count past the file": (lambda p: raw(p, b"", n_keys=1 << 40), "the key count claims"),
    "a file cut short": (lambda p: raw(p, string(b"llama.block_count") + struct.pack("<I", 4) + b"\1"), "cut short"),
    "a key twice": (
        lambda p: raw(p, (string(b"a") + struct.pack("<II", 4, 1)) * 2, n_keys=2),
        "key 'a' appears twice",
    ),
    "an array of arrays": (
        lambda p: raw(p, string(b"a") + struct.pack("<IIQ", 9, 9, 1) + b"\0" * 16),
        "llama.cpp reads no arrays of arrays",
    ),
    "a value type GGUF lacks": (lambda p: raw(p, string(b"a") + struct.pack("<I", 99) + b"\0" * 8), "value type 99"),
    "version 1": (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0)), "GGUF version 1"),
    "a tensor past the end": (
        lambda p: raw(p, string(b"rope_freqs.weight") + struct.pack("<IQIQ", 1, 8, 0, 1 << 50), n_tensors=1, n_keys=0),
        "past the end of the file",
    ),
    "a tensor claiming 2^60 values": (
        lambda p: raw(
            p, string(b"rope_freqs.weight") + struct.pack("<IQQIQ", 2, 1 << 30, 1 << 30, 0, 0), n_tensors=1, n_keys=0
        ),
        "claims 1152921504606846976 values",
    ),
}


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_gguf_structures_that_lie(tmp_path, capsys, name):
    write, said = STRUCTURES[name]
    f = tmp_path / "m.gguf"
    write(f)
    line = refused(capsys, tmp_path, f)
    assert "is not a readable GGUF file" in line and said in line, line
    if name == "an array claiming 2^60 items":
        assert f.stat().st_size == 60


def test_a_sparse_gguf_claiming_a_billion_strings(tmp_path, capsys):
    """4 GiB of zeros after a string array's header: 2^28 strings of 8 bytes fit, but are not walked."""
    f = raw(tmp_path / "m.gguf", string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 28))
    os.truncate(f, 4 << 30)
    assert "268435456 more strings; the audit walks past at most 2097152 in all" in refused(capsys, tmp_path, f)


def test_a_sparse_gguf_of_many_string_arrays(tmp_path, capsys):
    """Three arrays of 2^20 empty strings (zeros) each pass the limit of one array, but not of all."""
    f = tmp_path / "m.gguf"
    with open(f, "wb") as out:
        out.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 3))
        for name in (b"a", b"b", b"c"):
            out.write(string(name) + struct.pack("<IIQ", 9, 8, 1 << 20))
            out.seek(out.tell() + (8 << 20))
        out.truncate()
    assert "1048576 more strings; the audit walks past at most 2097152 in all" in refused(capsys, tmp_path, f)


@pytest.mark.parametrize("name", ["big.bin", "big.gguf"])
def test_a_multi_gigabyte_file_is_not_read_whole(tmp_path, capsys, name):
    """A 4 GiB file (sparse) that is no GGUF: its first bytes tell, the rest is never read."""
    f = tmp_path / name
    with open(f, "wb") as out:
        out.truncate(4 << 30)
    line = refused(capsys, tmp_path, f)
    said = "not a GGUF file" if name.endswith(".gguf") else "neither a GGUF file nor a model folder"
    assert said in line, line


def test_a_fifo_is_refused_without_waiting(tmp_path, capsys):
    """A FIFO would block a reader until something writes to it: refused before it is opened, and where it is
    opened (the export note), opened without waiting and refused."""
    os.mkfifo(tmp_path / "m.gguf")
    assert "is neither a GGUF file nor a model folder" in refused(capsys, tmp_path, tmp_path / "m.gguf")


# ----------------------------------------------------------------------------- config.json and --overrides
@pytest.fixture
def folder(tmp_path):
    from tests.tiny import tiny_config

    out = tmp_path / "model"
    out.mkdir()
    config = tiny_config("llama").to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}

    def write(**fields):
        (out / "config.json").write_text(json.dumps({**config, **fields}))
        return out

    return write


YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256}
CONFIGS = {
    "zero max_position_embeddings": ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
    "negative max_position_embeddings": ({"max_position_embeddings": -5}, "an integer >= 1, got -5"),
    "string max_position_embeddings": ({"max_position_embeddings": "abc"}, "an integer >= 1, got 'abc'"),
    "zero layers": ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
    "ten billion layers": ({"num_hidden_layers": 10**10}, "10000000000 layers: the audit reads at most 65536"),
    "a string factor": ({"rope_parameters": {**YARN, "factor": "four"}}, "factor must be a finite number, got 'four'"),
    "a zero factor": ({"rope_parameters": {**YARN, "factor": 0}}, "factor must be >= 1.0, got 0"),
    "a negative factor": ({"rope_parameters": {**YARN, "factor": -2.0}}, "factor must be >= 1.0, got -2.0"),
    "a zero base": ({"rope_parameters": {**YARN, "rope_theta": 0}}, "rope_theta must be > 1.0, got 0"),
    "a zero original length": (
        {"rope_parameters": {**YARN, "original_max_position_embeddings": 0}},
        "original_max_position_embeddings must be an integer >= 2, got 0",
    ),
    "an original length past 2**40": (  # the one bound of every reader of a length (methods.check_length)
        {"rope_parameters": {**YARN, "original_max_position_embeddings": 2**40 + 1}},
        "original_max_position_embeddings must be <= 2**40 = 1099511627776 tokens",
    ),
    "betas the wrong way round": (
        {"rope_parameters": {**YARN, "beta_fast": 1.0, "beta_slow": 32.0}},
        "beta_fast must be greater than beta_slow",
    ),
    "a string head_dim": ({"head_dim": "sixteen"}, "head_dim"),
    "an odd head_dim": ({"head_dim": 15}, "even rotary dimension"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_config_fields_of_the_wrong_type_or_range(tmp_path, capsys, folder, name, engine):
    fields, said = CONFIGS[name]
    line = refused(capsys, tmp_path, folder(**fields), "--engine", engine)
    assert said in line and "config.json" in line, line


def test_a_nan_factor_in_config_json(tmp_path, capsys, folder):
    """JSON's ``NaN`` literal, which Python's json reads: refused as the GGUF's is."""
    out = folder()
    (out / "config.json").write_text((out / "config.json").read_text().replace('"factor": 4.0', '"factor": NaN'))
    assert "factor must be a finite number, got nan" in refused(capsys, tmp_path, out, "--reference", out)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            {"rope_parameters": {**YARN, "factor": 0}},
            "(with the override JSON): rope_parameters: factor must be >= 1.0",
        ),
        ({"rope_parameters": {**YARN, "factor": "x"}}, "factor must be a finite number, got 'x'"),
        ({"max_position_embeddings": -1}, "(with the override JSON): max_position_embeddings must be an integer >= 1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
    ],
)
def test_overrides_with_impossible_fields(tmp_path, capsys, folder, overrides, said):
    line = refused(capsys, tmp_path, folder(), "--engine", "vllm", "--overrides", json.dumps(overrides))
    assert said in line, line


@pytest.mark.parametrize(
    ("text", "said"),
    [("[" * 100_000, "nested too deeply"), ("{'a': 1}", "is not valid JSON"), ('"text"', "must be a JSON object")],
)
def test_overrides_that_are_not_an_object(tmp_path, capsys, folder, text, said):
    assert said in refused(capsys, tmp_path, folder(), "--engine", "vllm", "--overrides", text)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"{not json", "is not valid JSON"),
        (b"[" * 100_000, "nested too deeply"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
        (b"[1, 2]", "is not a transformers config"),
        (None, "is larger than 16777216 bytes"),
    ],
)
def test_a_damaged_config_json(tmp_path, capsys, folder, content, said):
    out = folder()
    if content is None:  # 64 MiB of zeros (sparse): refused after reading at most 16 MiB
        os.truncate(out / "config.json", 64 << 20)
    else:
        (out / "config.json").write_bytes(content)
    assert said in refused(capsys, tmp_path, out)


# ------------------------------------------------------------------------------ the export's note
@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"{not json", "is not valid JSON"),
        (b'["a list"]', "is list, not a JSON object"),
        (b'{"tool": 5, "method": ["yarn"]}', "has tool, method that are not text"),
        (None, "is larger than 65536 bytes"),
    ],
)
def test_a_damaged_export_note_is_a_warning(tmp_path, capsys, folder, content, said):
    """The note describes the export (the audit reads the rope from the config itself): a damaged one is said as
    a warning and the verdict is the config's, quickly."""
    out = folder(rope_parameters=YARN)
    note = out / "rope-extend-export.json"
    if content is None:
        note.write_bytes(b"")
        os.truncate(note, 1 << 30)
    else:
        note.write_bytes(content)
    before = snapshot(tmp_path)
    capsys.readouterr()
    start = time.monotonic()
    code = main(["audit", str(out), "--engine", "vllm"])
    took = time.monotonic() - start
    text = capsys.readouterr().out
    assert code == 0 and "result: equal" in text and "warning: the export note" in text and said in text, text
    assert took < FAST and snapshot(tmp_path) == before


def test_a_good_export_note_is_said(tmp_path, capsys, folder):
    out = folder(rope_parameters=YARN)
    note = {"tool": "rope-extend 1.0", "engine": "vllm", "method": "yarn", "how": "exact"}
    (out / "rope-extend-export.json").write_text(json.dumps(note))
    capsys.readouterr()
    assert main(["audit", str(out), "--engine", "vllm"]) == 0
    assert "note: exported by rope-extend 1.0 for vllm: yarn (exact)" in capsys.readouterr().out
