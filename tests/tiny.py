"""The tests' tiny random-weight models and offline tokenizer: ``eval/tiny.py`` (the parity scripts in eval/
build their models with it too, and scripts must not import from tests/)."""

from eval.tiny import _COMMON, FAMILIES, TOKENIZER_TEXT, tiny_config, tiny_model, tiny_tokenizer

__all__ = ["FAMILIES", "TOKENIZER_TEXT", "_COMMON", "tiny_config", "tiny_model", "tiny_tokenizer"]
