"""The test matrix: each package alone, all of them together, the built wheels, and lint.

Package sessions install ONLY that package (and what its pyproject declares) from the
lock file into a fresh venv: a test that passes there proves the dependency list is
honest. `nox -l` lists the sessions; `nox -s stream -- -k prefetch` passes pytest args.
"""

from __future__ import annotations

import glob
import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

# package -> extras its own tests need
PACKAGES = {
    "core": ["nf4", "data", "tensorboard"],
    "stream": ["nf4"],
    "dora": [],
    "lmhead": [],
    "eval": ["data"],
}
TEST_TOOLS = ["pytest>=8", "pytest-xdist>=3"]
# test processes (pytest-xdist), each file in one of them: NARROWS_TEST_WORKERS, else 2 (CI's cores);
# one thread each, so two processes share two cores rather than oversubscribe them
WORKERS = os.environ.get("NARROWS_TEST_WORKERS", "2")


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into the session's venv (exact versions, no editable installs)."""
    venv = session.virtualenv.location
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-dev",
        "--no-editable",
        "--quiet",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": venv, "VIRTUAL_ENV": venv},
        external=True,
    )
    session.install(*TEST_TOOLS)


def _pytest(session: nox.Session, path: str) -> None:
    workers = ["-n", WORKERS, "--dist", "loadfile"] if WORKERS not in ("0", "1") else []
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    session.run("python", "-m", "pytest", path, "-q", *workers, *session.posargs, env=env)


def _make_package_session(name: str, extras: list[str]) -> None:
    def run(session: nox.Session) -> None:
        _sync(session, "--package", f"narrows-{name}", *(a for e in extras for a in ("--extra", e)))
        _pytest(session, f"packages/{name}/tests")

    run.__doc__ = f"narrows-{name} alone: its tests with only its declared dependencies installed"
    nox.session(name=name)(run)


for _name, _extras in PACKAGES.items():
    _make_package_session(_name, _extras)


@nox.session
def integration(session: nox.Session) -> None:
    """All packages together: the cross-package tests in tests/."""
    _sync(session)
    _pytest(session, "tests")


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every member with --no-sources, install the wheels in a clean venv, import each."""
    dist = os.path.join(session.create_tmp(), "dist")
    session.run("uv", "build", "--all-packages", "--no-sources", "--quiet", "-o", dist, external=True)
    wheels = sorted(glob.glob(os.path.join(dist, "*.whl")))
    if len(wheels) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels, built {len(wheels)}: {wheels}")
    session.run("python", "-c", _CHECK_WHEEL_CONTENTS, *wheels)
    session.install(*(f"{w}[nf4]" if "narrows_core" in w else w for w in wheels))
    session.run("python", "-c", _CHECK_IMPORTS, env={"HF_HUB_OFFLINE": "1"})
    session.run("narrows", "doctor")


_CHECK_WHEEL_CONTENTS = """
import sys, zipfile
for w in sys.argv[1:]:
    names = zipfile.ZipFile(w).namelist()
    assert 'narrows/__init__.py' not in names, f'{w} ships narrows/__init__.py and would shadow its siblings'
    assert any(n.startswith('narrows/') and n.endswith('/__init__.py') for n in names), f'{w} has no narrows.* package'
print(f'{len(sys.argv) - 1} wheels: no namespace __init__.py')
"""

_CHECK_IMPORTS = """
import importlib, importlib.metadata as md, narrows
assert getattr(narrows, '__file__', None) is None, 'narrows must stay a namespace package'
for name in ('core', 'stream', 'dora', 'lmhead', 'eval'):
    mod = importlib.import_module('narrows.' + name)
    assert mod.__version__ == md.version('narrows-' + name)
    assert 'site-packages' in mod.__file__, mod.__file__
    print('narrows.' + name, mod.__version__, 'from', mod.__file__)
from lm_eval.api.registry import get_model  # the wheel's .pth hook: `lm_eval --model narrows` just works
assert get_model('narrows').__module__ == 'narrows.eval.lm' and get_model('hf').__name__ == 'HFLM'
print('lm-eval finds the narrows model')
"""


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree; the layering's contracts
    (pyproject.toml's [tool.importlinter]) checked by import-linter on the sources."""
    session.install("ruff>=0.8", "import-linter>=2.10")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    sources = os.pathsep.join(sorted(glob.glob(os.path.join("packages", "*", "src"))))
    session.run("lint-imports", env={"PYTHONPATH": sources})
