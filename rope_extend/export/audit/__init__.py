"""``rope-extend audit``: the rotary frequencies and cos/sin scale each layer gets in a serving engine, compared
with what transformers computes for the same model.

    from rope_extend.export.audit import audit
    report = audit("model.gguf", reference="Qwen3-8B/")      # llama.cpp from the file's keys
    report = audit("folder/", engine="vllm", overrides={...})  # vLLM from config.json and --hf-overrides
    report = audit("folder/")                                  # transformers itself, with its known traps

The engine models are in ``gguf_file`` (llama.cpp), ``vllm_sglang`` (vLLM, SGLang) and ``reference`` (transformers,
through its own ``ROPE_INIT_FUNCTIONS`` and the model's rotary module). The files are read as hostile
(``untrusted``, ``gguf_read``: only regular files, every count and length held against the bytes there are) and
every value is checked before it is computed with (``gguf_file.settings``, ``reference.check``): a damaged or
impossible file is one line and exit 2. A difference beyond ``rope.FREQ_RTOL`` /
``SCALE_RTOL`` in any layer is a mismatch (exit 1). What is suspicious but cannot be proved without a reference
(a context longer than the original with no scaling, a local layer scaled, GPT-OSS's YaRN without
``truncate=false``, a LongRoPE original length that is never passed), and what an engine does by design (LongRoPE's
long factors for every sequence once the served context passes the original length), is a warning (exit 0).
"""

from __future__ import annotations

__all__ = ["audit"]


def audit(path, **options):
    """Audit ``path``; see ``rope_extend.export.audit.run.audit`` for the options. Returns a ``Report``
    (``text()``, ``as_dict()``, ``exit_code``: 1 on a mismatch)."""
    from .run import audit as run

    return run(path, **options)
