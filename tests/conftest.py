import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import rope_extend  # noqa: F401  (registers the rope types)


def pytest_collection_modifyitems(config, items):
    # the combination matrix (tests/matrix) has its own CI step, `pytest -m matrix tests/matrix`: a run whose -m
    # does not name it leaves it out, so the README's `pytest -q` does not run it a second time
    if "matrix" not in (config.option.markexpr or ""):
        matrix = [item for item in items if item.get_closest_marker("matrix")]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if not item.get_closest_marker("matrix")]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
