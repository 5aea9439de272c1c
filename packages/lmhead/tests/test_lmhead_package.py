"""narrows-lmhead installs alone (with only narrows-core) and joins the namespace."""

import importlib.metadata as md
import sys

import narrows.core
import narrows.lmhead


def test_version_matches_metadata():
    assert narrows.lmhead.__version__ == md.version("narrows-lmhead") == "0.1.0"


def test_depends_on_core_and_no_sibling():
    requires = md.requires("narrows-lmhead") or []
    names = {
        r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip() for r in requires
    }
    assert "narrows-core" in names
    assert not {n for n in names if n.startswith("narrows-")} - {"narrows-core"}


def test_importing_it_pulls_in_no_sibling():
    siblings = {"narrows.stream", "narrows.dora", "narrows.lmhead", "narrows.eval"} - {"narrows.lmhead"}
    assert not siblings & set(sys.modules)


def test_shares_the_namespace_with_core():
    assert narrows.core.__name__ == "narrows.core"
    assert len(list(__import__("narrows").__path__)) >= 1
