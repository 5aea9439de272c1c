"""Makes ``lm_eval --model narrows`` work without any import by the user.

lm-eval 0.4 finds models only in its own registry (no entry-point group for models). The
narrows-eval wheel puts this module and ``narrows_eval_lm_eval.pth`` at the top of
site-packages; the .pth imports it at interpreter start. It is a top-level module on
purpose: importing anything inside ``narrows.eval`` would run that package's ``__init__``
(torch, transformers) in every Python process. All it does is put a finder on
``sys.meta_path`` that waits for ``lm_eval.models`` (the module that fills lm-eval's
registry with lazy placeholders) and, once that has run, adds the placeholder
``narrows -> narrows.eval.lm:NarrowsLM``. Nothing is imported early: a process
that never imports lm-eval pays for one finder that declines every other module name.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "lm_eval.models"


class _RegisterNarrows(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from lm_eval.api.registry import model_registry

            if "narrows" not in model_registry:
                model_registry.register("narrows", target="narrows.eval.lm:NarrowsLM")

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if not any(isinstance(f, _RegisterNarrows) for f in sys.meta_path) and _TARGET not in sys.modules:
        sys.meta_path.insert(0, _RegisterNarrows())


install()
