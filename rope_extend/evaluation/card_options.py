"""The ``card`` command's options (a module of its own: the command line builds them without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import RopeExtendError
from ..schema import option
from .data import parse_lengths
from .effective import KEEP, RULER_THRESHOLD


@dataclass
class CardOptions:
    """What the card measures (the ``card`` command's options and ``card(options=...)``)."""

    lengths: list[Any] | None = option(
        None,
        help="lengths in tokens, e.g. [4k, 8k, 16k] (default: L/2 when L >= 2048, L, and doublings of L up to the target)",
    )
    samples: int = option(5, help="RULER samples per task and length")
    tasks: list[str] | None = option(None, help="RULER tasks (default: all of them)")
    answer_tokens: int | None = option(
        None, help="RULER's tokens to generate, for every task (default: RULER's budget per task, up to 128)"
    )
    trials: int = option(10, help="passkey trials per length")
    docs: int = option(1, help="perplexity documents (each at least the longest length)")
    text: str | None = option(
        None, help="the texts perplexity reads: a file, folder or canterbury (default: the bundled held-out corpus)"
    )
    chat_template: bool = option(True, help="RULER prompts in the tokenizer's chat template when it has one")
    threshold: float = option(RULER_THRESHOLD, help="RULER's effective-length bar, percent")
    keep: float = option(KEEP, help="the share of the score at L a length must keep (relative effective length)")
    engine: bool | Literal["llama.cpp", "vllm"] | None = option(
        None,
        help="also measure the export in a serving engine when the method exports exactly: the GGUF in llama.cpp "
        "(--engine or --engine llama.cpp; default: when llama-cpp-python and gguf are installed, the "
        "rope-extend[llama] extra) or the vLLM folder in vllm.LLM (--engine vllm); refused when the engine is "
        "not installed. A bare --engine goes after MODEL or before another option: the word after it, if any, "
        "must be an engine",
    )
    engine_lengths: list[Any] | None = option(
        None,
        help="the lengths the served export is measured at, some of --lengths (default: all of them; llama.cpp as "
        "built by pip is several times slower than torch on a CPU)",
    )
    seed: int = option(0, help="seed of every prompt")

    @property
    def engine_name(self) -> str:
        """The engine the served step runs in: ``vllm`` when named, else ``llama.cpp``."""
        return "vllm" if self.engine == "vllm" else "llama.cpp"

    def __post_init__(self):
        if self.engine not in (None, True, False, "llama.cpp", "vllm"):
            raise RopeExtendError(f"engine must be true, false, 'llama.cpp' or 'vllm', got {self.engine!r}")
        for name in ("samples", "trials", "docs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RopeExtendError(f"{name} must be a positive integer, got {value!r}")
        if self.lengths is not None:
            self.lengths = parse_lengths(self.lengths)
        if self.engine_lengths is not None:
            self.engine_lengths = parse_lengths(self.engine_lengths)
