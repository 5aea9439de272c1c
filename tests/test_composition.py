"""All five packages installed together: one namespace, one dependency shape."""

import importlib
import importlib.metadata as md

import pytest

PACKAGES = ["core", "stream", "dora", "lmhead", "eval"]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_package_resolves_through_the_namespace(name):
    mod = importlib.import_module(f"narrows.{name}")
    assert mod.__version__ == md.version(f"narrows-{name}")


def test_namespace_spans_one_directory_per_installed_distribution():
    import narrows

    dirs = {p for p in narrows.__path__}
    found = {importlib.import_module(f"narrows.{n}").__file__.split("narrows")[-2] for n in PACKAGES}
    assert len(dirs) >= 1 and found  # editable installs share or split dirs; both must resolve


def test_dependency_graph_is_a_star_around_core():
    for name in PACKAGES[1:]:
        deps = [r for r in md.requires(f"narrows-{name}") or [] if r.startswith("narrows-")]
        assert {d.split(">")[0].split("[")[0] for d in deps} == {"narrows-core"}, (name, deps)  # extras too
        assert all(">=0.1,<0.2" in d.replace(" ", "") for d in deps), deps
        assert len([d for d in deps if "extra ==" not in d]) == 1
    assert not [r for r in md.requires("narrows-core") or [] if r.startswith("narrows-")]


def test_cli_sees_every_installed_package():
    from narrows.core.app.doctor import collect

    report = collect()
    assert all(report.packages[f"narrows-{n}"] == "0.1.0" for n in PACKAGES)
