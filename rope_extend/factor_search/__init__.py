"""Search per-frequency rescale factors (LongRoPE) with perplexity as fitness: ``rope-extend search``."""
