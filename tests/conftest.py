import pytest

from narrows.core.testing import private_cache


@pytest.fixture(scope="session", autouse=True)
def _narrows_cache(tmp_path_factory):
    with private_cache(tmp_path_factory.mktemp("narrows-cache")):
        yield


@pytest.fixture
def interrupt_at(monkeypatch):
    """``interrupt_at(step)``: the run stops as Ctrl-C stops it when it logs `step` (that
    step's checkpoint not written); ``interrupt_at(None)`` lets runs finish again."""
    from narrows.core.app.finetune.run_folder import RunFolder

    log = RunFolder.log

    def at(step):
        def interrupted(self, row):
            if row["step"] == step:
                raise KeyboardInterrupt
            log(self, row)

        monkeypatch.setattr(RunFolder, "log", log if step is None else interrupted)

    return at
