"""Export a patched or configured model to a serving engine, with the scaling in the engine's own terms.

    from rope_extend.export import export
    export(model, "gguf", "model-yarn.gguf", tokenizer=tokenizer)        # a patched model
    export("smollm2-135m", "vllm", "out/", method="yarn", factor=4)       # a saved folder, or a name

Targets: ``gguf`` (llama.cpp; ``llamacpp``), ``vllm``, ``sglang`` and ``transformers4`` (``configs``), one
module each in ``targets/``, registered in ``TARGETS`` (an ``ExportTarget`` of one's own is one more). Each
method is exported, exported only with ``approximate=True`` (what changes is said), or refused with the
method, the engine, what the engine lacks and the nearest choice that exports (``routes``). ``out`` must not
exist; it is written under a temporary name and renamed when complete. Importing this package loads no torch.
"""

from __future__ import annotations

from .targets import TARGETS

__all__ = ["TARGETS", "export"]


def export(model, to: str, out, **options):
    """Export ``model`` for ``to``; see ``rope_extend.export.run.export`` for the options. Returns an
    ``ExportResult`` (``out``, ``how``, ``command`` that serves it, ``notes``)."""
    from .run import export as run

    return run(model, to, out, **options)
