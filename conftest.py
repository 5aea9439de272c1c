"""Shared by every test directory: GPU- and bitsandbytes-marked tests skip cleanly when
the machine or the environment lacks them (markers are registered in pyproject.toml), and
every test runs with deterministic kernels (narrows.core.deterministic's condition for
bit-identical results), so a test that needs nondeterminism to pass cannot."""

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_configure(config):
    import torch

    torch.use_deterministic_algorithms(True)


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "bnb" in item.keywords and not has_bnb:
            item.add_marker(pytest.mark.skip(reason="needs bitsandbytes (pip install 'narrows-core[nf4]')"))
