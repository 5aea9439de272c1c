import json
import subprocess
import sys

import pytest

from narrows.core.app.cli import main
from narrows.core.optional import OPTIONAL
from narrows.core.testing.processes import child_env


@pytest.fixture(scope="module")
def doctor_report() -> dict:
    """`narrows doctor --json` as a user runs it, once for the tests that read it."""
    out = subprocess.run(
        [sys.executable, "-m", "narrows.core.app.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=child_env(),
    ).stdout
    return json.loads(out)


def test_doctor_reports_versions_devices_and_backends(doctor_report):
    report = doctor_report
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
    out = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, check=True, env=child_env()
    ).stdout
    assert out.strip() == "narrows-core 0.1.0"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_env()
    )


def test_the_parser_builds_without_torch():
    """`narrows --help` answers in a fraction of a second: building the whole parser, the
    sibling packages' subcommands included, imports neither torch nor transformers nor peft."""
    code = (
        "import sys; from narrows.core.app.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules))"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# what each silenced notice needs to be raised, as a library user would meet it
_RAISE = {
    "bitsandbytes.backends.cpu.ops": "import bitsandbytes",
    "transformers.modeling_utils": "import types; "
    "from transformers import PreTrainedModel as P; "
    "P.is_gradient_checkpointing.fget(types.SimpleNamespace(is_activation_checkpointing=False))",
}


@pytest.mark.parametrize("source", sorted(_RAISE))
def test_third_party_notices_are_silenced_and_shown_by_doctor(source, doctor_report):
    from narrows.core.notices import NOTICES

    notice = next(n for n in NOTICES if n.source == source)
    plain = _python(_RAISE[source])
    if notice.pattern not in plain.stderr:
        pytest.skip(f"{source} does not raise {notice.pattern!r} on this machine")
    quiet = _python("import narrows.core; " + _RAISE[source])
    assert quiet.returncode == 0 and notice.pattern not in quiet.stderr, quiet.stderr
    assert any(n["message"].startswith(notice.pattern) for n in doctor_report["notices"])
