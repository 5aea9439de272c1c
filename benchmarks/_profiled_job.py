"""`narrows finetune` in this process, as `python -m narrows.core.app.cli finetune ...` runs
it, with the host side of its steps measured: peers.py's ``--host-profile`` for its
``finetune-<budget>`` rows.

The job runs ``WARMUP + PLAIN + PROFILED`` steps (its ``--steps``, which the caller sets). Each
time the job logs a step's row to metrics.jsonl (after the step's device work has finished,
the loop's own `_sync`), this wrapper notes the wall clock, the main thread's CPU time and
the process's CPU time. The ``PLAIN`` steps after the warm-up give the host seconds a step
without any profiler; the ``PROFILED`` steps after them run under cProfile (enabled at the
row of the last plain step, disabled at the row of the last profiled step, before the job's
final checkpoint; its clock is the wall clock), whose functions by own time and calls are
divided by ``PROFILED``. Nothing in the product is changed: the one seam is `RunFolder.log`,
wrapped here.

The main thread's CPU time is its host work only if it does not spin while it waits for the
GPU, which CUDA does by default (one context, many cores: ``cudaDeviceScheduleAuto`` spins).
So before anything touches CUDA this process asks the driver to block instead
(``cuDevicePrimaryCtxSetFlags(CU_CTX_SCHED_BLOCKING_SYNC)``; ``sync`` in the JSON says whether
it took): a wait then costs the thread no CPU, and the steps' wall time may grow by a wake-up a
wait, which is why the timed rows never run this way.

    python benchmarks/_profiled_job.py --warmup 2 --plain 10 --profiled 10 --stats S.json \\
        --prof P.prof -- finetune --model DIR --data FILE --steps 22 ...

With ``--device-profile`` one step more (the job's --steps one larger) runs under torch.profiler
after the cProfile steps: the device's time by kind of kernel, how busy the compute stream
was over the step and where it sat idle (stream_qlora.py's `device_categories`), so a step
whose device idles between kernels shows the host setting its pace.

With ``--sync-debug`` the step after those runs under ``torch.cuda.set_sync_debug_mode("warn")``:
every call that makes the host wait for the device (``.item()``, a copy to or from pageable
memory, ``nonzero``, ...) is listed with the product's frames that made it, by count. Each such
wait empties the device's queue: what the host launches next finds the device idle.

Writes ``--stats`` (JSON) and, with ``--prof``, the pstats file (``python -m pstats P.prof``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path


def where(key: tuple[str, int, str]) -> str:
    """'torch/nn/modules/module.py:1751(_call_impl)': the path after site-packages (or a
    staged site, or a package's src), else its last two parts."""
    file, line, name = key
    if file == "~":  # a builtin
        return name
    for cut in ("site-packages/", "/site/", "/src/"):
        if cut in file:
            file = file.rsplit(cut, 1)[1]
            break
    else:
        file = "/".join(Path(file).parts[-2:])
    return f"{file}:{line}({name})"


def blocking_sync() -> str:
    """Have the host block, not spin, while it waits for the device (the primary context's
    scheduling flag, set before the context exists); what happened, in words."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver"
    dev = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return "no CUDA device"
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    code = set_flags(dev, 0x04)  # CU_CTX_SCHED_BLOCKING_SYNC
    return "blocking" if code == 0 else f"default (cuDevicePrimaryCtxSetFlags returned {code})"


def sync_flags() -> str:
    """The scheduling flag the primary context of device 0 has now (after the job), in words."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver"
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return "no CUDA device"
    if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return "unknown"
    sched = {0: "auto", 1: "spin", 2: "yield", 4: "blocking"}.get(flags.value & 0x07, hex(flags.value))
    return f"{sched}{'' if active.value else ' (context inactive)'}"


def window(marks: dict[int, tuple[float, float, float, float]], first: int, last: int) -> dict:
    """Per-step deltas of the marks from step `first` (its row) to step `last`: wall, main
    thread CPU and process CPU seconds, and the job's own step_s, each step's."""
    steps = range(first + 1, last + 1)
    wall = [marks[s][0] - marks[s - 1][0] for s in steps]
    thread = [marks[s][1] - marks[s - 1][1] for s in steps]
    process = [marks[s][2] - marks[s - 1][2] for s in steps]
    step_s = [marks[s][3] for s in steps]
    return {
        "steps": len(steps),
        "wall_s": wall,
        "thread_cpu_s": thread,
        "process_cpu_s": process,
        "step_s": step_s,
        "median_wall_s": statistics.median(wall),
        "median_thread_cpu_s": statistics.median(thread),
        "median_process_cpu_s": statistics.median(process),
        "median_step_s": statistics.median(step_s),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, required=True, help="steps before any measurement (at least 1)")
    ap.add_argument("--plain", type=int, required=True, help="steps measured without the profiler")
    ap.add_argument("--profiled", type=int, required=True, help="steps under cProfile, after the plain ones")
    ap.add_argument("--stats", required=True, help="where the measurements go (JSON)")
    ap.add_argument("--prof", help="where the pstats file goes")
    ap.add_argument("--top", type=int, default=30, help="functions listed, by own time")
    ap.add_argument("--device-profile", action="store_true", help="one step more under torch.profiler (CUDA)")
    ap.add_argument("--trace", help="where the --device-profile step's Chrome trace goes (gzipped JSON)")
    ap.add_argument(
        "--sync-debug", action="store_true", help="one step more listing the host's waits on the device"
    )
    ap.add_argument("job", nargs=argparse.REMAINDER, help="-- finetune ARGS: the CLI's arguments")
    args = ap.parse_args()
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    if args.warmup < 1 or args.plain < 1 or args.profiled < 1:
        raise SystemExit("--warmup, --plain and --profiled: at least 1 step each")

    sync = blocking_sync()  # before torch touches CUDA
    from narrows.core.app import cli
    from narrows.core.app.finetune.run_folder import RunFolder

    plain_end = args.warmup + args.plain
    end = plain_end + args.profiled
    marks: dict[int, tuple[float, float, float, float]] = {}
    profiler = cProfile.Profile()
    device: dict = {}  # the torch.profiler step: its profiler, then its summary
    syncs: dict = {}  # the sync-debug step: its recorder, then what it saw
    sync_step = end + 1 + int(args.device_profile)  # the step it watches (its row ends it)
    threads: list[str] = []
    log = RunFolder.log

    def measured_log(self, row: dict) -> None:
        step = row.get("step")
        if "step_s" in row and isinstance(step, int):  # a training step's row (step 0's eval has none)
            if step == end:
                profiler.disable()
                threads.extend(t.name for t in threading.enumerate())
                if args.device_profile:
                    device["profiler"] = start_device_profile()
            if step == end + 1 and "profiler" in device:
                device.update(stop_device_profile(device.pop("profiler"), row["step_s"], args.trace))
            if args.sync_debug and step == sync_step - 1:
                syncs["recorder"] = SyncRecorder().start()
            if step == sync_step and "recorder" in syncs:
                syncs.update(syncs.pop("recorder").stop())
            marks[step] = (time.perf_counter(), time.thread_time(), time.process_time(), row["step_s"])
            if step == plain_end:
                profiler.enable()
        return log(self, row)

    RunFolder.log = measured_log
    try:
        code = cli.main(job)
    finally:
        profiler.disable()
        RunFolder.log = log
        if "profiler" in device:  # the job ended before the profiled step's row
            device.pop("profiler").stop()
        if "recorder" in syncs:
            syncs.pop("recorder").stop()
    out: dict = {"returncode": code, "python": platform.python_version(), "argv": job}
    out.update(sync=sync, sync_after=sync_flags())  # asked for before the job, and what its context had
    if not all(s in marks for s in range(args.warmup, end + 1)):
        out["error"] = f"the job logged steps {sorted(marks)}, not {args.warmup}..{end}"
        Path(args.stats).write_text(json.dumps(out, indent=2))
        return code or 1
    stats = pstats.Stats(profiler)
    if args.prof:
        stats.dump_stats(args.prof)
    n = args.profiled
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]  # type: ignore[attr-defined]
    out.update(
        plain=window(marks, args.warmup, plain_end),
        profiled=window(marks, plain_end, end),
        profiled_total_tottime_s_per_step=stats.total_tt / n,  # type: ignore[attr-defined]
        threads_at_end=threads,
        top_tottime=[
            {
                "function": where(key),
                "calls_per_step": nc / n,
                "primitive_calls_per_step": cc / n,
                "tottime_ms_per_step": tt / n * 1e3,
                "cumtime_ms_per_step": ct / n * 1e3,
            }
            for key, (cc, nc, tt, ct, _callers) in top
        ],
    )
    if args.device_profile:
        out["device_profile"] = device or {"error": f"no step {end + 1} logged"}
    if args.sync_debug:
        out["syncs"] = syncs or {"error": f"no step {sync_step} logged"}
    Path(args.stats).write_text(json.dumps(out, indent=2))
    return code


class SyncRecorder:
    """The host's waits on the device while it runs: torch's sync debug mode set to warn, each
    warning's stack cut to the frames outside torch and warnings, counted by that stack."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.kinds: dict[str, int] = {}

    def start(self) -> SyncRecorder:
        import traceback
        import warnings

        import torch

        self._show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            text = str(message).splitlines()[0][:80]
            if "synchroniz" not in text:
                return self._show(message, category, filename, lineno, file, line)
            frames = [
                f"{where((f.filename, f.lineno, f.name))}"
                for f in traceback.extract_stack()[:-1]
                if "site-packages/torch/" not in f.filename
                and "warnings" not in f.filename
                and "_profiled_job" not in f.filename
            ][-4:]
            key = " < ".join(reversed(frames))
            self.counts[key] = self.counts.get(key, 0) + 1
            self.kinds[text] = self.kinds.get(text, 0) + 1

        warnings.showwarning = show
        self._filters = warnings.filters[:]
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def stop(self) -> dict:
        import warnings

        import torch

        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        warnings.filters[:] = self._filters
        ranked = sorted(self.counts.items(), key=lambda kv: -kv[1])
        return {
            "waits": sum(self.counts.values()),
            "by_kind": self.kinds,
            "by_stack": [[n, k] for k, n in ranked[:40]],
        }


def start_device_profile():
    """torch.profiler running over host and CUDA activity, started now."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    prof = profile(activities=[ProfilerActivity.CPU, *cuda])
    prof.start()
    return prof


def stop_device_profile(prof, step_s: float, keep: str | None = None) -> dict:
    """The profiled step: its own step_s, the device's busy time, and stream_qlora.py's
    summary of its kernels and the compute stream's idle gaps; its trace gzipped at `keep`."""
    import gzip
    import shutil
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    from stream_qlora import device_categories

    prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        kinds = device_categories(json.loads(trace.read_text()))
        if keep:
            with trace.open("rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return {"step_s": step_s, **kinds}


if __name__ == "__main__":
    sys.exit(main())
