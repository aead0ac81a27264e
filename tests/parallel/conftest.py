import pytest

from tests.parallel._launch import close_pools


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/parallel/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_pools()
