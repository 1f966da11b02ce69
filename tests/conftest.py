import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (the README's `-n 2`) the workers share the cores: each gets its share of torch's threads, else
# 2 workers x 2 threads on 2 cores spin against each other (OpenMP's busy wait) and the run is slower than 1 worker.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # the processes the tests start

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
