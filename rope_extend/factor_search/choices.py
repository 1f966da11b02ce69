"""The search's named choices, in a module that imports nothing: the command line's parser lists them without
loading torch or transformers (``tests/test_deferred.py``)."""

# perplexity over the texts, or over needles' answer tokens (LongRoPE2): six documents, or one of five needles
FITNESSES = ("text", "needle", "needle-multiquery")
SPACES = ("longrope", "longrope2")  # LongRoPE's factor bounds, or LongRoPE2's split at the critical dimension
