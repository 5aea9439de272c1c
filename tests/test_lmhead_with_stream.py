"""narrows-lmhead and narrows-stream compose through core's head hook, in either order,
and under transformers.Trainer: streamed + lmhead is bit-identical to resident + lmhead."""

import pytest
import torch
from parity import assert_equal, run

import narrows.lmhead as lmh
import narrows.stream as ns
from narrows.core.testing import tiny_batch, tiny_model, with_adapter

ROWS = 48  # head rows per chunk: the same tiling for the resident and the streamed head


def build(arch="llama", dropout=0.05):
    return with_adapter(tiny_model(arch), "lora", dropout=dropout).train()


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])  # untied; tied + softcapping
@pytest.mark.parametrize("head", ["resident", "stream"])
@pytest.mark.parametrize("lmhead_first", [True, False])
def test_streamed_with_lmhead_equals_resident_with_lmhead(arch, head, lmhead_first):
    def streamed():
        m = build(arch)
        if lmhead_first:
            lmh.apply(m, head_rows=ROWS)
            ns.stream(m, device="cpu", head=head, head_rows=ROWS)
        else:
            ns.stream(m, device="cpu", head=head, head_rows=ROWS)
            lmh.apply(m, head_rows=ROWS)
        return m

    resident = run(lmh.apply(build(arch), head_rows=ROWS))
    assert_equal(resident, run(streamed()))


def test_topk_with_a_streamed_head_equals_resident(tmp_path):
    resident = run(lmh.apply(build("qwen3"), topk=16, neighbour_cache=tmp_path, head_rows=ROWS))
    m = ns.stream(build("qwen3"), device="cpu", head="stream", head_rows=ROWS)
    lmh.apply(m, topk=16, neighbour_cache=tmp_path, head_rows=ROWS)
    assert_equal(resident, run(m))


def test_trainer_with_lmhead_and_stream(tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {k: v[0] for k, v in tiny_batch(batch=1, seed=i, pad_last=0).items()}

    def train(use_lmhead, streamed):
        model = build("qwen3")
        if streamed:
            ns.stream(model, device="cpu", head="stream", head_rows=ROWS)
        if use_lmhead:
            lmh.apply(model, head_rows=ROWS)
        args = TrainingArguments(
            output_dir=str(tmp_path / f"{use_lmhead}{streamed}"),
            max_steps=3,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    hf = train(False, False)
    ours = train(True, False)
    assert len(ours) == 3 and ours == train(True, True)  # streamed: the same floats
    assert ours == pytest.approx(hf, rel=1e-5)  # against HF's own loss: summation order only


@pytest.mark.gpu
@pytest.mark.parametrize("head", ["resident", "stream"])
def test_cuda_streamed_with_lmhead_equals_resident_with_lmhead(head):
    # fused="off": a resident head could go to Cut Cross-Entropy, the streamed one cannot
    resident = run(
        lmh.apply(build("qwen2").to(torch.bfloat16).cuda(), head_rows=ROWS, fused="off"), device="cuda"
    )
    m = ns.stream(build("qwen2").to(torch.bfloat16), device="cuda", head=head, head_rows=ROWS)
    assert_equal(resident, run(lmh.apply(m, head_rows=ROWS, fused="off"), device="cuda"))


def test_the_planner_sees_that_lmhead_never_builds_the_logits():
    model = with_adapter(
        tiny_model("llama", vocab_size=32768), "lora"
    )  # a vocabulary where the logits dominate, and more logits than one tile
    full = ns.plan(model, None, device="cpu", seq_len=1024)
    lmh.apply(model)
    lean = ns.plan(model, None, device="cpu", seq_len=1024)
    assert lean.work_bytes < full.work_bytes / 3 and lean.predicted_peak < full.predicted_peak
    lmh.remove(model)
    assert ns.plan(model, None, device="cpu", seq_len=1024).work_bytes == full.work_bytes
