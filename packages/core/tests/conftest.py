import pytest

from narrows.core.testing import private_cache


@pytest.fixture(scope="session", autouse=True)
def _narrows_cache(tmp_path_factory):
    with private_cache(tmp_path_factory.mktemp("narrows-cache")):
        yield
