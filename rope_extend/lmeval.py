"""The lm-evaluation-harness model type ``rope-extend``: any lm-eval task on a patched model.

    rope-extend-lm-eval --model rope-extend \\
        --model_args pretrained=bundled,method=yarn,factor=4 --tasks rope_extend_passkey \\
        --include_path examples/lm_eval_tasks

(``python -m rope_extend.lmeval ...`` is the same command.) lm-eval 0.4 finds model types only in its own
registry, filled when a module that registers one is imported; the command above imports this module and
then runs lm-eval's own command line with the same arguments. From Python::

    import rope_extend.lmeval  # registers "rope-extend" (and "rope_extend")
    lm_eval.simple_evaluate(model="rope-extend", model_args="pretrained=PATH,method=yarn,factor=4", tasks=[...])

or ``rope_extend.lmeval.evaluate(...)``, which does both. The model is loaded with rope-extend's loader
(``rope_extend.loading``: safetensors only, ``trust_remote_code`` off unless given, a ``.gguf`` file or
``gguf_file=``, the names ``bundled`` and ``smollm2-135m``), patched with ``rope_extend.patch`` and handed
to lm-eval's Hugging Face model (``HFLM``) with ``max_length`` set to the patched target length (``factor *
L``), so lm-eval truncates only beyond it. Model arguments are checked: one rope-extend does not know is
an error that names it and lists the allowed ones.

lm-eval is an optional dependency (``pip install 'rope-extend[lm_eval]'``); ``import rope_extend`` never
imports it, and importing this module without it works (``RopeExtendLM`` and ``evaluate`` then raise).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from .errors import RopeExtendBaseError, RopeExtendError, closest
from .methods import registry as _methods
from .scaling import ScalingRequest

logger = logging.getLogger("rope_extend")

INSTALL_HINT = "pip install 'rope-extend[lm_eval]'"
MODEL_NAMES = ("rope-extend", "rope_extend")

# Arguments rope-extend's loader takes (``loading.load_model`` / ``load_tokenizer``).
LOAD_ARGUMENTS = ("pretrained", "tokenizer", "dtype", "device", "trust_remote_code", "gguf_file", "attn_implementation")
# Arguments of ``rope_extend.patch`` besides the method parameters.
PATCH_ARGUMENTS = ("method", "factor", "target_length", "original_max_position_embeddings")
# lm-eval ``HFLM`` arguments that make sense for a model rope-extend has already loaded and patched.
HFLM_ARGUMENTS = (
    "batch_size",
    "max_batch_size",
    "max_length",
    "truncation",
    "logits_cache",
    "add_bos_token",
    "prefix_token_id",
    "softmax_dtype",
    "mixed_precision_dtype",
    "think_end_token",
    "enable_thinking",
    "chat_template_args",
)


def method_parameters() -> list[str]:
    """Every parameter name some registered method takes, plus ``logn`` (any method takes it) and
    ``keep_shipped`` (any attention method)."""
    names: list[str] = []
    for name in _methods.names():
        for f in dataclasses.fields(_methods.get(name).params):
            if f.name not in names:
                names.append(f.name)
    return [*names, "logn", "keep_shipped"]


def allowed_arguments() -> list[str]:
    return [*LOAD_ARGUMENTS, *PATCH_ARGUMENTS, *method_parameters(), *HFLM_ARGUMENTS]


@dataclasses.dataclass
class Arguments:
    """``model_args`` sorted by who takes them."""

    load: dict[str, Any]
    scaling: ScalingRequest | None  # None: run the model as it is
    hflm: dict[str, Any]


def _value(value: Any) -> Any:
    """lm-eval already turns ``4`` into 4 and ``true`` into True; a list or a quoted string stays text, read
    here as YAML (``short_factor`` lists for LongRoPE)."""
    if isinstance(value, str):
        from .schema import parse_value

        return parse_value(value)
    return value


def split_arguments(args: dict[str, Any]) -> Arguments:
    """Check ``model_args`` against what rope-extend knows and sort them; an unknown one is an error naming
    it and listing the allowed ones. A factor or method parameter without ``method`` is an error too (it
    would silently evaluate the unscaled model)."""
    allowed = allowed_arguments()
    for key in args:
        if key not in allowed:
            raise RopeExtendError(
                f"unknown model argument {key!r} for --model rope-extend{closest(key, allowed)}; allowed: "
                f"{', '.join(allowed)}"
            )
    load = {k: v for k, v in args.items() if k in LOAD_ARGUMENTS}
    hflm = {k: v for k, v in args.items() if k in HFLM_ARGUMENTS}
    params = set(method_parameters())
    if load.get("pretrained") in (None, ""):
        raise RopeExtendError(
            "--model rope-extend needs pretrained=PATH (a model folder, a .gguf file, 'bundled' or a hub name)"
        )
    requested = {k: (_value(v) if k in params else v) for k, v in args.items() if k in PATCH_ARGUMENTS or k in params}
    scaling = ScalingRequest.from_values(requested, spell=lambda key: f"{key.removeprefix('params.')}=")
    return Arguments(load, scaling if scaling.scales else None, hflm)


def _device(device: str | None) -> str:
    """The device to load on: lm-eval's command line passes ``cuda:0`` when none is given, so a CUDA device
    on a machine without CUDA falls back to the CPU (as lm-eval's own ``hf`` model does)."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %r asked for but CUDA is not available: evaluating on the CPU", device)
        return "cpu"
    return str(device)


def load_patched(args: Arguments):
    """``(model, tokenizer, scaling)``: loaded with ``rope_extend.loading``, patched if a method is given
    (``scaling`` is then ``rope_extend.patched(model)``, else None)."""
    from . import loading
    from .patching import patched

    load = dict(args.load)
    pretrained = str(load.pop("pretrained"))
    tokenizer_name = load.pop("tokenizer", None) or pretrained
    trust = bool(load.pop("trust_remote_code", False))
    gguf = {"gguf_file": load["gguf_file"]} if load.get("gguf_file") else {}
    model = loading.load_model(
        pretrained,
        dtype=load.get("dtype"),
        device=_device(load.get("device")),
        trust_remote_code=trust,
        attn_implementation=load.get("attn_implementation") or "sdpa",
        **gguf,
    )
    tokenizer = loading.load_tokenizer(str(tokenizer_name), trust_remote_code=trust, **gguf)
    if args.scaling is None:
        return model, tokenizer, None
    args.scaling.apply(model)
    scaling = patched(model)
    if scaling is None:  # Arguments keeps only a spec that scales (none is kept as None), and patch raises on failure
        raise RopeExtendError(f"{args.scaling.describe()} left the model unpatched")
    logger.info("rope-extend: evaluating %s", scaling.describe())
    return model, tokenizer, scaling


try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as exc:  # lm-eval is optional
    _MISSING: ImportError | None = exc
else:
    _MISSING = None

    class RopeExtendLM(HFLM):
        """lm-eval's Hugging Face model on a model rope-extend loaded and patched.

        ``model_args``: ``pretrained`` (required), ``tokenizer``, ``dtype``, ``device``, ``trust_remote_code``,
        ``gguf_file``, ``attn_implementation``; ``method``, ``factor`` or ``target_length``,
        ``original_max_position_embeddings`` and the method's parameters (``beta_fast``, ``group_size``,
        ``window``, ``logn``, ...); and the lm-eval options in ``HFLM_ARGUMENTS`` (``batch_size``,
        ``max_length``, ...). ``max_length`` defaults to the patched target length. ``self.scaling`` is the
        scaling applied (None without ``method``).
        """

        def __init__(self, pretrained=None, **kwargs):
            args = split_arguments({"pretrained": pretrained, **kwargs})
            model, tokenizer, scaling = load_patched(args)
            hflm = dict(args.hflm)
            if hflm.get("max_length") is None:
                hflm["max_length"] = scaling.target_length if scaling is not None else None
            if scaling is not None and scaling.factor == 1 and "max_length" not in args.hflm:
                logger.warning(
                    "%s: the target length is the original length %d, so lm-eval truncates inputs to it; pass "
                    "factor=, target_length= or max_length= to evaluate longer inputs",
                    scaling.method.name,
                    scaling.target_length,
                )
            super().__init__(pretrained=model, tokenizer=tokenizer, **hflm)
            self.scaling = scaling

    if __name__ != "__main__":  # run as a script, the module registers when main() imports it by name
        register_model(*MODEL_NAMES)(RopeExtendLM)


def _require() -> None:
    if _MISSING is not None:
        raise RopeExtendError(f"the lm-eval integration needs lm-evaluation-harness ({_MISSING}): {INSTALL_HINT}")


def __getattr__(name: str):
    if name == "RopeExtendLM":
        _require()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def evaluate(model_args: str | dict[str, Any], tasks, **options):
    """``lm_eval.simple_evaluate(model="rope-extend", model_args=..., tasks=..., **options)``; ``model_args``
    is a string (``"pretrained=bundled,method=yarn,factor=4"``) or a dict. Give ``task_manager=`` (an
    ``lm_eval.tasks.TaskManager(include_path=...)``) for tasks outside lm-eval, such as the example task."""
    _require()
    import lm_eval

    return lm_eval.simple_evaluate(model=MODEL_NAMES[0], model_args=model_args, tasks=tasks, **options)


def main(argv: list[str] | None = None) -> None:
    """``rope-extend-lm-eval ARGS`` / ``python -m rope_extend.lmeval ARGS``: lm-eval's command line with the
    ``rope-extend`` model type registered (``ARGS`` are lm-eval's: ``--model rope-extend --model_args ...``)."""
    if _MISSING is not None:
        print(
            f"rope-extend-lm-eval: lm-evaluation-harness is not importable ({_MISSING}): {INSTALL_HINT}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except RopeExtendBaseError as exc:  # a bad argument or model: its message, not a traceback through lm-eval
        print(f"rope-extend-lm-eval: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        sys.argv = saved


if __name__ == "__main__":
    from rope_extend.lmeval import main as _main  # the module by its name, so the model type is registered once

    _main()
