"""What identifies the model a record was measured on: a digest of its weights and config.

A record's model name is whatever the user typed (``m``, ``./out/model``); two different models can share
it, and a folder can be overwritten in place. The digest is computed from the model in memory, so it is
exactly what was measured (the dtype it was loaded in included), whatever files it came from:

- every tensor of ``state_dict()``: its name, dtype and shape, and the SHA-256 of its bytes (a tensor on
  a GPU is copied to the CPU one at a time). Hashing bytes is exact and the same on every device and run.
- the config: the bytes of ``config.json`` when the model was loaded from a local folder that holds one (so
  a scaling patched in memory does not change it), else the config's JSON without its path and version.

It costs one pass of SHA-256 over the weights (about 0.3 s for 134M bfloat16 parameters on one busy CPU
core) and is cached on the model until a tensor is replaced or written in place (torch counts in-place
writes in ``Tensor._version``; writes through ``tensor.data`` are not counted: ``forget_digest`` after them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch

from ..hf.names import DIGEST


def _update(h, tensor) -> None:
    """Feed ``tensor``'s bytes to the hash ``h`` (nothing for a tensor without data, e.g. on the meta device)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    h.update(flat.view(torch.uint8).numpy().data)


def _config_bytes(model) -> bytes:
    config = getattr(model, "config", None)
    if config is None:
        return b""
    path = Path(str(getattr(config, "_name_or_path", "") or "")) / "config.json"
    if str(getattr(config, "_name_or_path", "") or "") and path.is_file():
        return path.read_bytes()
    data = config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        data.pop(key, None)
    return json.dumps(data, sort_keys=True, default=str).encode()


def model_digest(model) -> str:
    """A 16-hex-digit digest of ``model``'s weights and config (see the module docstring)."""
    state = model.state_dict() if hasattr(model, "state_dict") else {}
    key = (
        type(model).__name__,
        tuple((name, t.data_ptr(), t._version, tuple(t.shape), str(t.dtype)) for name, t in state.items()),
    )
    cached = getattr(model, DIGEST, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    h = hashlib.sha256(type(model).__name__.encode() + b"\0" + _config_bytes(model))
    for name, tensor in sorted(state.items()):
        h.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        _update(h, tensor)
    digest = h.hexdigest()[:16]
    with contextlib.suppress(AttributeError, TypeError):  # an object that takes no attributes: computed each time
        object.__setattr__(model, DIGEST, (key, digest))
    return digest


def forget_digest(model) -> None:
    """Drop the cached digest (after writing weights through ``tensor.data``, which torch does not count)."""
    model.__dict__.pop(DIGEST, None)


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of what decides how a tokenizer turns text into ids: its class, its vocabulary, its special tokens
    and, for a fast tokenizer, its whole serialised pipeline (normalizer, pre-tokenizer, merges). A prompt built from
    text (passkey, needle, RULER) is only the same prompt for the same tokenizer."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    special = getattr(tokenizer, "special_tokens_map", {}) or {}
    h.update(json.dumps(special, sort_keys=True, default=str).encode())
    return h.hexdigest()
