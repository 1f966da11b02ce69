"""Long-context evaluation: passkey retrieval, needle-in-a-haystack heatmaps, RULER's synthetic tasks,
perplexity, and reports.

    from rope_extend.evaluation import passkey, niah, perplexity
    result = passkey(model, tokenizer, "1k,2k,4k", trials=10)
    result.accuracy  # {1024: 1.0, 2048: 0.9, 4096: 0.2}

Protocols and sources are in each module's docstring; ``rope-extend eval`` runs them from the command line.
"""

from .niah import niah
from .passkey import passkey
from .perplexity import PerplexityResult, perplexity
from .retrieval import RetrievalResult
from .ruler import RulerResult, ruler

__all__ = ["PerplexityResult", "RetrievalResult", "RulerResult", "niah", "passkey", "perplexity", "ruler"]
