"""``rope-extend export``: write a model for a serving engine with the scaling in the engine's own terms."""

from __future__ import annotations

import argparse

from ..arguments import add_json_argument, add_method_arguments, add_trust_argument, print_result, scaling_from_args


def _cmd(args: argparse.Namespace) -> int:
    from . import export
    from .routes import check_target

    check_target(args.to)  # before anything is read
    spec = scaling_from_args(args)
    amounts = {"method": spec.method, **spec.patch_kwargs()} if spec.scales else {}
    result = export(
        args.model,
        args.to,
        args.out,
        approximate=args.approximate,
        dtype=args.dtype,
        tokenizer_pre=args.tokenizer_pre,
        trust_remote_code=args.trust_remote_code,
        **({"buckets": args.buckets} if args.buckets is not None else {}),
        **amounts,
    )
    print_result(result.as_dict(), as_json=args.json)
    return 0


def register(sub) -> None:
    from .targets import TARGETS

    p = sub.add_parser(
        "export",
        help="write a model for llama.cpp (GGUF), vLLM, SGLang or transformers 4 with the scaling in their own keys",
    )
    p.add_argument("model", help="saved model folder, or a name rope-extend knows (smollm2-135m)")
    p.add_argument("--to", required=True, metavar="TARGET", help=f"one of: {', '.join(TARGETS)}")
    p.add_argument("--out", required=True, help="file (gguf) or folder to write; must not exist")
    add_method_arguments(p)
    p.add_argument(
        "--approximate",
        action="store_true",
        help="export a method the engine serves only approximately (dynamic methods made static, LongRoPE's "
        "switch, llama.cpp's group attention); the output says what changes",
    )
    p.add_argument(
        "--buckets",
        help="dynamic_yarn to vllm: the factors a request can get, comma-separated (default: powers of two up to "
        "the factor, then the factor), each request the smallest covering its prompt + max_tokens",
    )
    p.add_argument("--dtype", default="f32", help="GGUF weights: f32, f16, bf16 or q8_0 (default f32)")
    p.add_argument(
        "--tokenizer-pre",
        help="llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer rope-extend does not know",
    )
    add_trust_argument(p)
    add_json_argument(p)
    p.set_defaults(func=_cmd)
