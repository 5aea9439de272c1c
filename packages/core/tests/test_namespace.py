"""`narrows` is an implicit namespace shared by five distributions: one stray
`src/narrows/__init__.py` would shadow every sibling."""

import importlib
from pathlib import Path

import narrows
import narrows.core

REPO = Path(__file__).resolve().parents[3]


def test_narrows_is_a_namespace_package():
    assert getattr(narrows, "__file__", None) is None
    assert narrows.__spec__.origin in (None, "namespace")
    assert hasattr(narrows, "__path__")


def test_no_package_declares_the_namespace():
    packages = REPO / "packages"
    if not packages.is_dir():  # running from an installed wheel: the namespace check above suffices
        return
    strays = sorted(str(p.relative_to(REPO)) for p in packages.glob("*/src/narrows/__init__.py"))
    assert strays == []
    assert sorted(p.name for p in packages.glob("*/src/narrows/*") if p.is_dir()) == sorted(
        p.name for p in packages.iterdir() if (p / "pyproject.toml").is_file()
    )


def test_core_public_api_is_importable():
    for name in narrows.core.__all__:
        assert hasattr(narrows.core, name), name
    assert narrows.core.__version__ == importlib.metadata.version("narrows-core")


def test_core_does_not_import_optional_backends():
    import subprocess
    import sys

    from narrows.core.testing.processes import child_env

    code = "import sys, narrows.core; print(sorted(m for m in ('bitsandbytes', 'triton', 'lm_eval', 'peft') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=child_env()
    ).stdout
    assert out.strip() == "[]"
