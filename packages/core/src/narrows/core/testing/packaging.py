"""Checks every narrows package's own tests run: installed alone (with only narrows-core),
it joins the namespace, depends on core's 0.1 range and on no sibling."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import subprocess
import sys

__all__ = ["check_package_alone"]

SIBLINGS = ("narrows.stream", "narrows.dora", "narrows.lmhead", "narrows.eval")


def check_package_alone(name: str) -> None:
    """`name` is the short package name ("stream"); call from that package's tests."""
    dist = f"narrows-{name}"
    mod = importlib.import_module(f"narrows.{name}")
    assert mod.__version__ == md.version(dist), (mod.__version__, md.version(dist))
    requires = [r for r in md.requires(dist) or [] if r.startswith("narrows-")]
    names = {re.split(r"[\[<>=;\s]", r, maxsplit=1)[0] for r in requires}
    assert names == {"narrows-core"}, f"{dist} depends on {sorted(names)}; only narrows-core is allowed"
    assert all(">=0.1,<0.2" in r.replace(" ", "") for r in requires), requires
    others = sorted(set(SIBLINGS) - {f"narrows.{name}"})
    code = f"import sys, narrows.{name}; print(sorted(m for m in {others!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing narrows.{name} pulled in {out.strip()}"
    import narrows

    assert getattr(narrows, "__file__", None) is None, "narrows must stay an implicit namespace package"
