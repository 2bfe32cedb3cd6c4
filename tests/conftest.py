"""What several test files set up alike, one section each: the session's environment and markers;
the torch trainer's tiny model. The project's modules (and torch) are imported inside the helpers
that use them, so a test module loads only what its own tests need."""

import os

import pytest

# ---- the session: no model hub, asyncio for anyio tests, GPU tests opt-in ------------------------

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def pytest_collection_modifyitems(config, items):
    if config.getoption("-m") and "gpu" in config.getoption("-m"):
        return
    skip_gpu = pytest.mark.skip(reason="GPU test: opt in with `pytest -m gpu` on a GPU machine")
    for item in items:
        # The marker, not `item.keywords`: keywords hold the folder names too, so a checkout in a
        # folder named `gpu` would skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


# ---- the torch trainer on the tiny model ---------------------------------------------------------


@pytest.fixture(scope="module")
def restore_torch_threads():
    """The trainer sets torch's process-wide thread count; give later test modules theirs back.
    A module that trains opts in with `pytestmark = pytest.mark.usefixtures("restore_torch_threads")`."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """One tiny model folder (default shape, seed 0) for a test module's trainers to load."""
    from pipeline.tasks.tiny_model import make_model_folder

    return make_model_folder(tmp_path_factory.mktemp("tiny") / "model", seed=0)
