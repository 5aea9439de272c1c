import json
import subprocess
import sys

import pytest

from narrows.core._env import OPTIONAL
from narrows.core.cli import main


def test_doctor_reports_versions_devices_and_backends():
    out = subprocess.run([sys.executable, "-m", "narrows.core.cli", "doctor", "--json"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    report = json.loads(out)
    assert report["packages"]["narrows-core"] == "0.1.0"
    assert report["dependencies"]["torch"] and report["dependencies"]["transformers"]
    assert report["devices"][0]["name"] == "cpu"
    assert set(report["optional"]) == {dist for dist, _ in OPTIONAL.values()}
    assert {"bitsandbytes", "triton", "lm-eval", "gguf"} <= set(report["optional"])
    for info in report["optional"].values():
        assert isinstance(info["usable"], bool) and info["note"]


def test_doctor_text(capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "narrows-core" in text and "optional backends" in text and "devices" in text


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_console_script_is_installed():
    import shutil
    from pathlib import Path

    exe = Path(sys.executable).with_name("narrows")
    exe = str(exe) if exe.exists() else shutil.which("narrows")
    if exe is None:
        pytest.skip("no `narrows` script beside this interpreter or on PATH (installed with --target?)")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "narrows-core 0.1.0"
