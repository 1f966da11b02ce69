"""rope-extend: read longer contexts with RoPE models in Hugging Face transformers.

    import rope_extend
    rope_extend.patch(model, "yarn", factor=4)

Importing the package registers rope-extend's rope types with transformers, so a config with
``rope_parameters={"rope_type": "ntk_by_parts", ...}`` validates, builds, saves and reloads.
"""

from __future__ import annotations

from .errors import NotPatchedError, RopeExtendError, UnsupportedModelError
from .hf import configure, register as _register, rope_parameters
from .methods import get as get_method, inv_freq, names as methods
from .patch import patch, patched, unpatch

__version__ = "0.1.0"

_register()

__all__ = [
    "NotPatchedError", "RopeExtendError", "UnsupportedModelError", "configure", "get_method", "inv_freq",
    "methods", "patch", "patched", "rope_parameters", "unpatch", "__version__",
]
