"""Shared test setup: offline, deterministic, GPU tests skip cleanly on CPU."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu/run.sh on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fastkit_logs_reach_caplog():
    """fastkit's logger does not propagate by default (it has its own handler); caplog needs it to."""
    import logging

    logger = logging.getLogger("fastkit")
    old = logger.propagate
    logger.propagate = True
    yield
    logger.propagate = old


@pytest.fixture(scope="session")
def tokenizer():
    from fastkit.families.twins import twin_tokenizer

    return twin_tokenizer()
