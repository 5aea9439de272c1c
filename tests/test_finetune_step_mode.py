"""`narrows finetune --step-mode` (block-major accumulation through narrows-stream's
StepTrainer), with `--offload-optimizer` (which implies it) and `--cuda-graphs` (emulated
on the CPU), and neither asked (narrows-stream's choice, with its reason): the adapter and
every logged loss are `torch.equal` to the plain resident loop's, with dropout, and across
a resume. Bad combinations are refused before loading."""

import json

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.cli import main
from narrows.core.testing import tiny_model_folder, write_jsonl

ROWS = [{"text": " ".join(f"w{(7 * i + j) % 50}" for j in range(20))} for i in range(12)]
BUDGET = "1000KiB"  # every layer of the tiny model streamed (the minimum is 885 KiB: dropout's masks priced)
DORA_BUDGET = "1100KiB"  # the same with DoRA, which the fast layers leave to PEFT's modules (1.06 MiB)


def run(tmp_path, name, *extra):
    model = tiny_model_folder(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return main(
        [
            "finetune",
            "--model",
            str(model),
            "--data",
            str(data),
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--rank",
            "4",
            "--eval-rows",
            "0",
            "--grad-accum",
            "3",
            "--dropout",
            "0.1",
            "--save-every",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / name),
            *extra,
        ]
    )


def result(tmp_path, name):
    folder = tmp_path / name
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return load_file(folder / "adapter_model.safetensors"), rows


def assert_same(a, b):
    (wa, ra), (wb, rb) = a, b
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["loss"] for r in ra if "loss" in r] == [r["loss"] for r in rb if "loss" in r]


def test_step_mode_trains_what_the_resident_loop_trains(tmp_path, capsys):
    assert run(tmp_path, "resident") == 0
    assert run(tmp_path, "step", "--gpu-budget", BUDGET, "--step-mode") == 0
    # --offload-optimizer runs in step mode: it implies it
    assert run(tmp_path, "hosted", "--gpu-budget", BUDGET, "--offload-optimizer", "--cuda-graphs") == 0
    assert run(tmp_path, "auto", "--gpu-budget", BUDGET) == 0  # neither asked: the prediction's choice
    # the adapters in host memory too; the final evaluation needs them back on the device
    evals = str(tmp_path / "train.jsonl")
    capsys.readouterr()
    assert (
        run(
            tmp_path,
            "adapters",
            "--gpu-budget",
            BUDGET,
            "--offload-adapters",
            "--cuda-graphs",
            "--eval-data",
            evals,
            "--eval-rows",
            "2",
        )
        == 0
    )
    assert "adapters and optimizer state in host memory between uses" in capsys.readouterr().err
    reference = result(tmp_path, "resident")
    for name in ("step", "hosted", "auto", "adapters"):
        assert_same(reference, result(tmp_path, name))
    assert "eval_loss" in result(tmp_path, "adapters")[1][-1]
    graphed = json.loads((tmp_path / "adapters" / "summary.json").read_text())["stream"]
    assert graphed["cuda_graph_replays"] > 0 and not graphed["cuda_graphs_refused"], graphed
    adapters = json.loads((tmp_path / "adapters" / "config.json").read_text())["config"]
    assert adapters["offload_optimizer"] is True and adapters["step_mode"] is True
    for name in (
        "step",
        "hosted",
        "adapters",
    ):  # dropout: each micro-batch is seeded, so every step runs block-major
        assert [r["accumulation"] for r in result(tmp_path, name)[1] if "loss" in r] == ["block-major"] * 3
    assert json.loads((tmp_path / "hosted" / "config.json").read_text())["config"]["step_mode"] is True
    auto = json.loads((tmp_path / "auto" / "summary.json").read_text())["stream"]
    assert "accumulation" not in result(tmp_path, "auto")[1][0]  # not StepTrainer
    assert auto["accumulation"].startswith("sequential (cpu device: no host→device link to spare)")
    summary = json.loads((tmp_path / "step" / "summary.json").read_text())
    assert summary["stream"]["resident_layers"] == 0 and summary["stream"]["accumulation"].startswith(
        "block-major (asked for"
    )
    # graphs: the planner's choice unless asked for (a CPU has none); asked for, they are emulated
    assert summary["stream"]["cuda_graphs"] is False
    assert summary["stream"]["cuda_graphs_choice"] == "auto: not a CUDA device"
    assert json.loads((tmp_path / "step" / "config.json").read_text())["config"]["cuda_graphs"] is None
    hosted = json.loads((tmp_path / "hosted" / "summary.json").read_text())["stream"]
    assert (
        hosted["cuda_graphs"] is True
        and hosted["cuda_graph_replays"] > 0
        and hosted["cuda_graph_captures"] > 0
    )


def test_the_predictions_choice_drives_the_loop_and_a_refusal_falls_back(tmp_path, monkeypatch, capsys):
    """The job trains block-major when narrows-stream's choice says so (stubbed here: a
    CPU never gets it), and goes on in sequence, the same numbers, where StepTrainer then
    refuses the model; asked for with --step-mode, the refusal stands."""
    import narrows.stream as ns
    from narrows.stream.planning import accumulation
    from narrows.stream.stepmode.blockmajor import BlockMajorStep

    monkeypatch.setattr(accumulation, "choose_step_mode", lambda model, g, **kw: (True, "block-major (stub)"))
    assert run(tmp_path, "resident") == 0
    assert run(tmp_path, "chosen", "--gpu-budget", BUDGET) == 0
    reference = result(tmp_path, "resident")
    assert_same(reference, result(tmp_path, "chosen"))
    assert [r["accumulation"] for r in result(tmp_path, "chosen")[1]] == ["block-major"] * 3
    assert json.loads((tmp_path / "chosen" / "summary.json").read_text())["stream"]["accumulation"] == (
        "block-major (stub)"
    )

    def refuse(self, micro):
        raise ns.StreamSetupError("step mode: the model changes the hidden states between layers 0 and 1")

    monkeypatch.setattr(BlockMajorStep, "_capture", refuse)
    capsys.readouterr()
    assert run(tmp_path, "fallback", "--gpu-budget", BUDGET) == 0
    assert "sequential, step mode refused this model (step mode: the model changes" in capsys.readouterr().err
    assert_same(reference, result(tmp_path, "fallback"))
    assert "accumulation" not in result(tmp_path, "fallback")[1][0]
    assert run(tmp_path, "asked", "--gpu-budget", BUDGET, "--step-mode") == 2
    assert "the model changes the hidden states" in capsys.readouterr().err


def test_step_mode_trains_dora_as_the_resident_loop_does(tmp_path):
    pytest.importorskip("narrows.dora")
    assert run(tmp_path, "resident", "--adapter", "dora") == 0
    assert run(tmp_path, "step", "--adapter", "dora", "--gpu-budget", DORA_BUDGET, "--step-mode") == 0
    got = result(tmp_path, "step")
    assert_same(result(tmp_path, "resident"), got)
    assert [r["accumulation"] for r in got[1]] == ["block-major"] * 3
    assert any("lora_magnitude_vector" in k for k in got[0])


def test_step_mode_resumes_exactly(tmp_path, interrupt_at):
    """Ctrl-C during step 3 (after step 2's checkpoint), then --resume: a fresh StepTrainer
    seeds each micro-batch from its index again, the optimizer state comes back from the checkpoint."""
    flags = ("--gpu-budget", BUDGET, "--step-mode", "--offload-optimizer")
    assert run(tmp_path, "whole", *flags) == 0
    interrupt_at(3)
    assert run(tmp_path, "cut", *flags) == 130  # Ctrl-C
    interrupt_at(None)
    assert not (tmp_path / "cut" / "adapter_model.safetensors").exists()
    assert main(["finetune", "--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    assert_same(result(tmp_path, "whole"), result(tmp_path, "cut"))


def test_offloaded_state_leaves_the_budget(tmp_path, capsys):
    """A budget below the minimum with every adapter's state on the GPU is refused with
    the offload as a way out, and trains with --offload-optimizer or --offload-adapters
    (the plan leaves what waits in host memory out), the same numbers as the resident loop."""
    small = "870KiB"  # below the minimum (885 KiB), above it with the state in host memory (853 KiB and less)
    assert run(tmp_path, "full", "--gpu-budget", small) == 2
    assert "--offload-adapters" in capsys.readouterr().err
    assert run(tmp_path, "resident") == 0
    for flag in ("--offload-optimizer", "--offload-adapters"):
        assert run(tmp_path, flag, "--gpu-budget", small, flag) == 0
        assert_same(result(tmp_path, "resident"), result(tmp_path, flag))
    plan = json.loads((tmp_path / "--offload-adapters" / "summary.json").read_text())["stream"]
    assert plan["predicted_peak"] <= 870 * 1024


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--step-mode"], "--step-mode applies to the layers of a streamed base"),
        (["--cuda-graphs"], "--cuda-graphs applies to the layers of a streamed base"),
        (["--offload-optimizer"], "--offload-optimizer applies to the layers of a streamed base"),
        (
            ["--gpu-budget", BUDGET, "--no-step-mode", "--offload-optimizer"],
            "--offload-optimizer updates each layer inside a step-mode step, and step mode is off",
        ),
        (["--offload-adapters"], "--offload-adapters applies to the layers of a streamed base"),
        (
            ["--gpu-budget", BUDGET, "--no-step-mode", "--offload-adapters"],
            "--offload-adapters updates each layer inside a step-mode step, and step mode is off",
        ),
        (["--gpu-budget", BUDGET, "--offload-adapters", "--grad-accum", "1"], "add --grad-accum N (N ≥ 2)"),
    ],
)
def test_bad_step_mode_flags_are_refused_before_loading(tmp_path, capsys, flags, message):
    assert run(tmp_path, "run", *flags) == 2
    err = capsys.readouterr().err
    assert "narrows: error:" in err and message in err
    assert not (tmp_path / "run").exists()


def test_moe_router_logits_keep_the_job_in_sequence_or_stop_it_when_asked(tmp_path, monkeypatch, capsys):
    """A MoE base with its router's aux loss on (qwen2_moe, output_router_logits=True): step
    mode cannot collect the router logits. Chosen by the job (stubbed: a CPU never gets
    it), StepTrainer refuses when built and the run goes on in sequence, saying why — the
    same numbers as the resident loop; asked for with --step-mode, it stops with the
    reason. (It used to die with an IndexError inside transformers' load-balancing loss.)"""

    model = tiny_model_folder(tmp_path / "moe", "qwen2_moe", output_router_logits=True)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)

    def moe(name, *extra):
        return main(
            [
                "finetune",
                "--model",
                str(model),
                "--data",
                str(data),
                "--steps",
                "1",
                "--batch",
                "2",
                "--seq-len",
                "32",
                "--rank",
                "4",
                "--eval-rows",
                "0",
                "--grad-accum",
                "2",
                "--dropout",
                "0.1",
                "--no-progress",
                "--out",
                str(tmp_path / name),
                *extra,
            ]
        )

    assert moe("resident") == 0
    from narrows.stream.planning import accumulation

    monkeypatch.setattr(accumulation, "choose_step_mode", lambda model, g, **kw: (True, "block-major (stub)"))
    capsys.readouterr()
    assert moe("chosen", "--gpu-budget", "1700KiB") == 0  # every layer streamed (the minimum is 1.57 MiB)
    err = capsys.readouterr().err
    assert (
        "sequential, step mode refused this model (step mode cannot train this model exactly: MoE router "
        "logits are on (config.output_router_logits=True" in err
    )
    assert_same(result(tmp_path, "resident"), result(tmp_path, "chosen"))
    assert moe("asked", "--gpu-budget", "1700KiB", "--step-mode") == 2
    err = capsys.readouterr().err
    assert "narrows: error: step mode cannot train this model exactly: MoE router logits are on" in err
    assert "Traceback" not in err


def test_the_jobs_flags_map_to_one_stream_config():
    """`stream_config` is the one place the job's flags become stream settings: budget,
    batch, tiles, graphs and what step mode keeps in host memory; the planner's choices
    stay "auto" where no flag overrides them."""
    import narrows.stream as ns
    from narrows.core.app.finetune.build import stream_config
    from narrows.core.app.finetune.config import FinetuneConfig

    cpu = torch.device("cpu")
    cfg = FinetuneConfig.of(gpu_budget="3GiB", batch=2, seq_len=32)
    got = stream_config(cfg, cpu)
    assert got == ns.StreamConfig(gpu_budget=3 * 2**30, device=cpu, batch_size=2, seq_len=32, kernels="fast")
    assert (got.graphs, got.seq_tile, got.host_state, got.step_mode, got.grad_accum) == (
        "auto",
        None,
        "none",
        "auto",
        1,
    )
    told = cfg.replace(
        gpu_budget="fit",
        seq_tile="1024",
        cuda_graphs=False,
        offload_optimizer=True,
        offload_adapters=True,
        step_mode=True,
    )
    got = stream_config(told.replace(grad_accum=4), cpu, world_size=2)
    assert (got.gpu_budget, got.seq_tile, got.graphs, got.host_state) == ("fit", 1024, False, "adapters")
    assert (got.grad_accum, got.step_mode, got.world_size) == (4, True, 2)
    assert stream_config(told.replace(offload_adapters=False), cpu).host_state == "optimizer"
    # one vocabulary for the budget in Python and on the command line: "min" is the smallest footprint
    smallest = cfg.replace(gpu_budget="min").checked()
    # a check returns a new configuration with what the settings imply; the one checked stays
    asked = FinetuneConfig.of(gpu_budget="1GiB", grad_accum=2, offload_adapters=True)
    implied = asked.checked()
    assert (implied.memory.offload_optimizer, implied.memory.step_mode) == (True, True)
    assert (asked.memory.offload_optimizer, asked.memory.step_mode) == (False, None)
    assert stream_config(smallest, cpu).gpu_budget == "min" == ns.StreamConfig(gpu_budget="min").gpu_budget
    # packed batches have one shape and evaluations run with the graphs released: no room is
    # left for a layer run eagerly beside their pool; unpacked widths vary, so it is
    assert stream_config(cfg.replace(packing=True), cpu).eager_beside_graphs is False
    assert stream_config(cfg, cpu).eager_beside_graphs is True
