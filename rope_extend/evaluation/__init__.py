"""Long-context evaluation: passkey retrieval, needle-in-a-haystack heatmaps, RULER's synthetic tasks,
perplexity, and reports.

    from rope_extend.evaluation import passkey, niah, perplexity
    result = passkey(model, tokenizer, "1k,2k,4k", trials=10)
    result.accuracy  # {1024: 1.0, 2048: 0.9, 4096: 0.2}

Protocols and sources are in each module's docstring; ``rope-extend eval`` runs them from the command line.
"""

# ruff: noqa: TC004 (the TYPE_CHECKING imports name what lazy_exports provides at run time)
from typing import TYPE_CHECKING

from ..deferred import lazy_exports

if TYPE_CHECKING:  # the names for type checkers; at run time lazy_exports imports them on first use
    from .niah import niah
    from .passkey import passkey
    from .perplexity import PerplexityResult, perplexity
    from .retrieval import RetrievalResult
    from .ruler.harness import RulerResult, ruler

lazy_exports(  # on first use: ``rope-extend --help`` does not import the evaluations
    __name__,
    {
        "niah": (".niah", "niah"),
        "passkey": (".passkey", "passkey"),
        "perplexity": (".perplexity", "perplexity"),
        "PerplexityResult": (".perplexity", "PerplexityResult"),
        "RetrievalResult": (".retrieval", "RetrievalResult"),
        "ruler": (".ruler", "ruler"),
        "RulerResult": (".ruler", "RulerResult"),
    },
)

__all__ = ["PerplexityResult", "RetrievalResult", "RulerResult", "niah", "passkey", "perplexity", "ruler"]
