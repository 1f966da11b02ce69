"""Search per-frequency rescale factors (LongRoPE) with perplexity as fitness, of the texts or of needles' answers
(LongRoPE2): ``rope-extend search``."""
