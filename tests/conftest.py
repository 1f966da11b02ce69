import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import rope_extend  # noqa: F401  (registers the rope types)


def pytest_collection_modifyitems(config, items):
    # the combination matrix (tests/matrix) and the sequence-parallel runs (marker `parallel`) have their own CI
    # steps, `pytest -m matrix tests/matrix` and `pytest -m parallel ...`: a run whose -m does not name them leaves
    # them out, so the README's `pytest -q` does not run them a second time
    for marker in ("matrix", "parallel"):
        if marker not in (config.option.markexpr or ""):
            own = [item for item in items if item.get_closest_marker(marker)]
            if own:
                config.hook.pytest_deselected(items=own)
                items[:] = [item for item in items if not item.get_closest_marker(marker)]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
