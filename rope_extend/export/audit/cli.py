"""``rope-extend audit PATH``: what rope each layer gets in a serving engine, against transformers; exit 1 on a
mismatch."""

from __future__ import annotations

import argparse
import json

from ...arguments import add_json_argument
from ...errors import RopeExtendError
from ...untrusted import decode_json


def _overrides(text: str | None):
    if text is None:
        return None
    value = decode_json(text, f"--overrides {text[:80]!r}")
    if not isinstance(value, dict):
        raise RopeExtendError(f"--overrides must be a JSON object, got {text[:80]!r}")
    return value


def _cmd(args: argparse.Namespace) -> int:
    from . import audit

    report = audit(
        args.path,
        reference_path=args.reference,
        overrides=_overrides(args.overrides),
        engine=args.engine,
        length=args.length,
    )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return report.exit_code


def register(sub) -> None:
    p = sub.add_parser(
        "audit",
        help="compare the rope each layer gets in llama.cpp (a GGUF), vLLM or SGLang (a folder and its override "
        "JSON), mlx-lm or transformers with transformers' reference; exit 1 on a mismatch",
    )
    p.add_argument("path", help="a .gguf file, or a model folder (or its config.json)")
    p.add_argument(
        "--reference",
        metavar="FOLDER_OR_CONFIG",
        help="the transformers model (folder or config.json) the file should serve; default: the folder's own config "
        "(vllm, sglang), none for a GGUF file (then only what is suspicious is said)",
    )
    p.add_argument(
        "--engine",
        choices=("vllm", "sglang", "mlx", "transformers"),
        help="how a folder is read: by vLLM 0.33, SGLang 0.5.23, mlx-lm 0.32.2 or transformers (default)",
    )
    p.add_argument(
        "--overrides",
        metavar="JSON",
        help="the engine's override JSON (vLLM's --hf-overrides, SGLang's --json-model-override-args)",
    )
    p.add_argument(
        "--length",
        type=int,
        help="the context the engine is started with (-c, --max-model-len, --context-length); default: the longest "
        "the file or config allows",
    )
    add_json_argument(p)
    p.set_defaults(func=_cmd)
