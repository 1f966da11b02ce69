"""Run the serving engines' own rotary code on the CPU, without the engines' heavy dependencies.

vLLM's and SGLang's rotary modules (``get_rope`` and the classes it builds) compute their cos/sin caches in
plain torch; what they import around that (custom-op registration, the platform, triton, logging) is
replaced here by inert stand-ins, so the exported config is read by the engine's own ``get_rope`` and its
cache compared with rope-extend's. The engine files come from the engines' PyPI wheels (``.ci/engines``
extracts them into ``ROPE_EXTEND_ENGINES``, default ``~/.cache/rope-extend/engines``); nothing is copied
into this repository.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path

import torch

ENGINES = Path(os.environ.get("ROPE_EXTEND_ENGINES", Path.home() / ".cache" / "rope-extend" / "engines"))
VLLM = ENGINES / "vllm-0.33.0"
SGLANG = ENGINES / "sglang-0.5.23"
TRANSFORMERS4 = ENGINES / "transformers-4.57.1"


class Inert:
    """Any attribute, call, item or decorator use gives an inert value (a decorated function is kept)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return Inert()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return Inert()

    def __getitem__(self, key):
        return Inert()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())


class CustomOp(torch.nn.Module):
    """The engines' custom-op base, reduced to its native path."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    @classmethod
    def register(cls, name=None, *args, **kwargs):
        return lambda klass: klass

    register_oot = register

    @classmethod
    def enabled(cls):
        return False

    def forward(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


class _Platform(Inert):
    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda *a, **k: name == "is_cpu"
        return Inert()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert()


class _Finder:
    """Serves stub modules for every ``prefix.*`` module outside the engine's real rotary package."""

    def __init__(self, prefix: str, real: tuple[str, ...], overrides: dict[str, dict]):
        self.prefix, self.real, self.overrides = prefix, real, overrides

    def find_spec(self, name, path=None, target=None):
        if name != self.prefix and not name.startswith(self.prefix + "."):
            return None
        if any(name == r or name.startswith(r + ".") for r in self.real):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__dict__.update(self.overrides.get(spec.name, {}))
        return module

    def exec_module(self, module):
        pass


def _load(root: Path, prefix: str, real: str, overrides: dict[str, dict]):
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]
    finder = _Finder(prefix, (real,), overrides)
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, str(root))
    try:
        parent = real.rsplit(".", 1)[0]
        for i in range(1, parent.count(".") + 2):  # the real package's parents are stubs with the real path
            name = ".".join(real.split(".")[:i])
            if name not in sys.modules:
                module = importlib.import_module(name)
                module.__path__ = [str(root / name.replace(".", "/"))]
        return importlib.import_module(real)
    finally:
        sys.path.remove(str(root))


class _Logger(logging.LoggerAdapter):
    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})

    def warning_once(self, *args, **kwargs):
        self.warning(*args, **kwargs)

    def info_once(self, *args, **kwargs):
        self.info(*args, **kwargs)

    debug_once = info_once


class _VllmConfig:
    class model_config:
        max_model_len = 0


def vllm_rotary():
    """vLLM 0.33.0's ``rotary_embedding`` package (``get_rope``); ``vllm_config().model_config.max_model_len``
    is what its LongRoPE reads."""
    overrides = {
        "vllm.model_executor.custom_op": {"CustomOp": CustomOp, "PluggableLayer": CustomOp},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.logger": {"init_logger": _Logger},
        "vllm.config": {"get_current_vllm_config": lambda: _VllmConfig},
    }
    return _load(VLLM, "vllm", "vllm.model_executor.layers.rotary_embedding", overrides)


def sglang_rotary():
    """SGLang 0.5.23's ``rotary_embedding`` package (``get_rope``)."""
    overrides = {
        "sglang.srt.custom_op": {"CustomOp": CustomOp},
        "sglang.kernels.fused_op": {"BaseFusedOp": CustomOp},
        "sglang.srt.platforms": {"current_platform": _Platform()},
        "sglang.srt.runtime_context": {"publish_role": lambda *a, **k: None},
        "sglang.srt.layers.utils.custom_op": {"CustomOp": CustomOp},
        "sglang.srt.utils": {
            "is_cuda": lambda: False,
            "is_hip": lambda: False,
            "is_npu": lambda: False,
            "is_cpu": lambda: True,
            "get_compiler_backend": lambda: "eager",
        },
    }
    return _load(SGLANG, "sglang", "sglang.srt.layers.rotary_embedding", overrides)


def transformers4_rope():
    """transformers 4.57.1's ``modeling_rope_utils`` (``ROPE_INIT_FUNCTIONS``, ``dynamic_rope_update``), loaded
    under a package name of its own (``_transformers4``) so that the installed transformers 5 stays untouched;
    its two relative imports (``PretrainedConfig``, only in annotations, and ``utils``) are stand-ins."""
    package = "_transformers4"
    utils = types.ModuleType(f"{package}.utils")
    utils.is_torch_available = lambda: True  # type: ignore[attr-defined]
    utils.logging = types.SimpleNamespace(get_logger=logging.getLogger)  # type: ignore[attr-defined]
    configuration = types.ModuleType(f"{package}.configuration_utils")
    configuration.PretrainedConfig = object  # type: ignore[attr-defined]
    root = types.ModuleType(package)
    root.__path__ = []  # a package, so the file's relative imports resolve in it
    sys.modules.update({package: root, utils.__name__: utils, configuration.__name__: configuration})
    name = f"{package}.modeling_rope_utils"
    spec = importlib.util.spec_from_file_location(name, TRANSFORMERS4 / "transformers" / "modeling_rope_utils.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def available(root: Path) -> bool:
    return root.is_dir()
