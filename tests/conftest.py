import os

import pytest

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
