"""The export targets (a module of its own so that the command line lists them without loading torch)."""

TARGETS = ("gguf", "vllm", "sglang", "transformers4")
