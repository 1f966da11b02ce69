"""Where the model and tokenizer come from (the pluggable part): a saved folder or hub name, or a
config that builds random weights, with an offline byte-level BPE tokenizer trained on the data."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..loading import load_model, load_tokenizer, parse_dtype
from .args import ModelArgs, RecipeError
from .data import train_bpe_tokenizer


def build_model(args: ModelArgs, texts: list[str], seed: int):
    """``(model in train mode, tokenizer)``."""
    if args.name_or_path is not None:
        model = load_model(
            args.name_or_path,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
            attn_implementation=args.attn_implementation,
        )
        tokenizer = load_tokenizer(args.tokenizer or args.name_or_path, trust_remote_code=args.trust_remote_code)
        return model.train(), tokenizer

    if args.config is None:  # a recipe checks exactly one of the two; ModelArgs built in Python may not have been
        raise RecipeError("model: give name_or_path (a model to load) or config (one to build), got neither")
    fields = dict(args.config)
    model_type = fields.pop("model_type")
    if args.tokenizer is not None:
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        tokenizer = train_bpe_tokenizer(texts, int(fields.get("vocab_size", 512)))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        fields.setdefault(name, getattr(tokenizer, name))
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=parse_dtype(args.dtype), attn_implementation=args.attn_implementation
    )
    return model.train(), tokenizer
