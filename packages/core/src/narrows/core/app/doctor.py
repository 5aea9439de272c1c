"""`narrows doctor`: what a bug report needs — versions, devices, which narrows packages
and optional backends can be used here."""

from __future__ import annotations

import contextlib
import platform
import sys
from dataclasses import dataclass

from ..memory import format_bytes, host_rss_bytes
from ..optional import NARROWS_PACKAGES, OPTIONAL, distribution_version, is_available

__all__ = ["DoctorReport", "collect", "render"]

_CORE_DEPS = ("torch", "transformers", "peft", "safetensors")


@dataclass
class DoctorReport:
    python: str
    platform: str
    packages: dict[str, str | None]  # narrows distributions -> version or None
    dependencies: dict[str, str | None]
    optional: dict[str, dict[str, object]]  # backend -> {version, usable, note}
    devices: list[dict[str, object]]
    host: dict[str, object]
    notices: list[dict[str, str]]  # third-party messages narrows silences: {"message", "why"}

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def _probe_bitsandbytes() -> tuple[bool, str]:
    try:
        import bitsandbytes.functional as F
        import torch

        w = torch.randn(64, 64)
        q, qs = F.quantize_4bit(w, quant_type="nf4")
        F.dequantize_4bit(q, qs)
        return True, "NF4 quantise/dequantise ran on CPU"
    except Exception as e:  # any failure is the answer the user needs
        return False, f"{type(e).__name__}: {e}"


def _probe_triton() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "installed, but kernels need a CUDA device (eager fallback is used)"
    return True, "CUDA device present"


def _probe_notices() -> list[dict[str, str]]:
    """The messages `notices` silences that this machine raises: bitsandbytes imported
    (its logger's filter records what it said), transformers' deprecated property read."""
    import warnings
    from types import SimpleNamespace

    from ..notices import NOTICES, seen

    raised = []
    if is_available("bitsandbytes"):
        with contextlib.suppress(Exception):  # a failure is reported under optional backends
            import bitsandbytes  # noqa: F401
        raised += seen()
    with warnings.catch_warnings(record=True) as caught, contextlib.suppress(Exception):
        warnings.simplefilter("always")
        from transformers import PreTrainedModel

        prop = getattr(PreTrainedModel, "is_gradient_checkpointing", None)
        if isinstance(prop, property):  # what PEFT reads when it wraps a model
            prop.fget(SimpleNamespace(is_activation_checkpointing=False, modules=lambda: []))
    raised += [str(w.message) for w in caught]
    return [{"message": m, "why": n.why} for m in raised for n in NOTICES if m.startswith(n.pattern)]


def collect() -> DoctorReport:
    import torch

    optional: dict[str, dict[str, object]] = {}
    for module, (dist, extra) in OPTIONAL.items():
        version = distribution_version(dist)
        usable, note = False, f"not installed (pip install '{extra or dist}')"
        if version is not None and is_available(module):
            if module == "bitsandbytes":
                usable, note = _probe_bitsandbytes()
            elif module == "triton":
                usable, note = _probe_triton()
            else:
                usable, note = True, "importable"
        optional[dist] = {"version": version, "usable": usable, "note": note}

    devices: list[dict[str, object]] = [{"name": "cpu", "threads": torch.get_num_threads()}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "name": f"cuda:{i}",
                    "model": p.name,
                    "memory": p.total_memory,
                    "capability": f"{p.major}.{p.minor}",
                }
            )

    host: dict[str, object] = {"rss": host_rss_bytes()}
    try:
        import os

        host["memory"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host["cpus"] = os.cpu_count()
    except (ValueError, OSError, AttributeError):
        pass
    return DoctorReport(
        python=sys.version.split()[0],
        platform=platform.platform(),
        packages={dist: distribution_version(dist) for dist in NARROWS_PACKAGES.values()},
        dependencies={d: distribution_version(d) for d in _CORE_DEPS}
        | {"torch.cuda": torch.version.cuda or "cpu-only build"},
        optional=optional,
        devices=devices,
        host=host,
        notices=_probe_notices(),
    )


def render(report: DoctorReport) -> str:
    lines = [f"narrows doctor — Python {report.python} on {report.platform}", "", "narrows packages:"]
    for dist, v in report.packages.items():
        lines.append(f"  {dist:<16} {v or 'not installed (pip install ' + dist + ')'}")
    lines += ["", "dependencies:"]
    lines += [f"  {d:<16} {v or 'MISSING'}" for d, v in report.dependencies.items()]
    lines += ["", "optional backends:"]
    for dist, info in report.optional.items():
        mark = "yes" if info["usable"] else "no "
        lines.append(f"  {dist:<16} {mark}  {info['version'] or '-':<10} {info['note']}")
    lines += ["", "devices:"]
    for d in report.devices:
        if d["name"] == "cpu":
            lines.append(f"  cpu              {d['threads']} torch threads")
        else:
            lines.append(f"  {d['name']:<16} {d['model']}, {format_bytes(d['memory'])}, sm {d['capability']}")
    if not any(d["name"] != "cpu" for d in report.devices):
        lines.append("  (no CUDA device: narrows runs its CPU paths)")
    if "memory" in report.host:
        lines += ["", f"host: {report.host.get('cpus')} CPUs, {format_bytes(report.host['memory'])} RAM"]
    lines += ["", "notices (silenced in narrows' output; nothing to act on, shown for bug reports):"]
    lines += [f"  {n['message']}\n    why: {n['why']}" for n in report.notices] or ["  none raised here"]
    return "\n".join(lines)
