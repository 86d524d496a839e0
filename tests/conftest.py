"""Shared test setup: offline, deterministic, GPU tests skip cleanly on CPU."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of .ci/run's two workers: one thread each on two cores
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


SERIAL = {
    "test_distributed.py": "two torchrun / accelerate processes per test, each on one thread, with gloo timeouts",
    "test_launch.py": "starts two processes per test (fastkit.launch), from a Jupyter kernel too",
    "test_browser.py": "JupyterLab + Chromium driven with wall-clock waits (up to 240 s per element)",
}
"""Test files marked ``serial``: .ci/run runs them last, alone on the machine, not beside the two xdist workers. Each
needs the whole machine: several processes of its own, or a wall-clock limit that a busy machine can miss."""


LLAMA_CPP_ITEMS = {"test_docs_code.py": "export.md"}
"""Tests that reach llama.cpp through fastkit without naming it in their file: file -> a part of the test's id
(docs/export.md's code blocks make a K-quant, which llama.cpp's quantizer writes)."""


def _uses_llama_cpp(path) -> bool:
    """A test file that loads llama.cpp (``llama_cpp``, directly or through tests/gguf_round_trip.py)."""
    text = path.read_text(encoding="utf-8")
    return "llama_cpp" in text or "gguf_round_trip" in text


def _reorder(items, order: str) -> None:
    """FASTKIT_TEST_ORDER, for flake hunts: ``reverse`` (files last to first, each file's tests last to first) or
    ``random:SEED`` (files shuffled, each file's tests shuffled; the same seed gives the same order in every xdist
    worker, which xdist requires). A file's tests stay together, so module fixtures are set up once either way."""
    import random

    by_file: dict = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    files = list(by_file.values())
    if order == "reverse":
        files.reverse()
        for group in files:
            group.reverse()
    elif order.startswith("random:") and order[7:].isdigit():
        rng = random.Random(int(order[7:]))
        rng.shuffle(files)
        for group in files:
            rng.shuffle(group)
    else:
        raise pytest.UsageError(f"FASTKIT_TEST_ORDER={order!r}: use 'reverse' or 'random:SEED' (e.g. random:7)")
    items[:] = [item for group in files for item in group]


def pytest_report_header(config):
    order = os.environ.get("FASTKIT_TEST_ORDER")
    return f"test order: FASTKIT_TEST_ORDER={order}" if order else None


def pytest_collection_modifyitems(config, items):
    """``serial`` (:data:`SERIAL`) and ``llamacpp`` (files that load llama.cpp: .ci/run runs them once its build is
    done) markers by file; GPU tests skip without CUDA; FASTKIT_TEST_ORDER reorders (:func:`_reorder`)."""
    if os.environ.get("FASTKIT_TEST_ORDER"):
        _reorder(items, os.environ["FASTKIT_TEST_ORDER"])
    uses_llama_cpp: dict = {}
    for item in items:
        path = item.path
        if path.name in SERIAL:
            item.add_marker(pytest.mark.serial)
        if uses_llama_cpp.setdefault(path, _uses_llama_cpp(path)) or LLAMA_CPP_ITEMS.get(path.name, "\0") in item.name:
            item.add_marker(pytest.mark.llamacpp)
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


@pytest.fixture
def fastkit_log(caplog):
    """caplog for the 'fastkit' logger, which has its own handler and does not propagate."""
    import logging

    log = logging.getLogger("fastkit")
    log.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="fastkit"):
        yield caplog
    log.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def tokenizer():
    from fastkit.families.twins import twin_tokenizer

    return twin_tokenizer()
