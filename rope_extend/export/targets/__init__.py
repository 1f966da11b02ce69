"""The export targets: one module per engine, each defining a ``TARGET`` (an ``ExportTarget``, ``base``).

``TARGETS`` is the one registry of them (``rope_extend.registry``); the built-in ones are registered lazily,
by module path, so that the command line lists them without loading torch. A target of one's own is one
module plus its test: an ``ExportTarget`` subclass registered with ``TARGETS.register(MyTarget())``.
"""

from typing import Any

from ...registry import Registry

# of base.ExportTarget, in the order of the README's serving table; typed Any because base imports this package
# for TARGETS and the import graph has no circles, not even for the type checker (tests/test_structure.py)
TARGETS: Registry[Any] = Registry("export target")
for _name in ("gguf", "vllm", "sglang", "transformers4", "mlx"):
    TARGETS.register_lazy(_name, f"{__name__}.{_name}:TARGET")
