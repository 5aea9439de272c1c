"""`StreamConfig`: every setting in one frozen object, validated once, refusals naming the field;
`stream`/`plan` take it or the same settings as keywords, with the same result."""

import dataclasses

import pytest
import torch
from helpers import build, train

import narrows.stream as ns
from narrows.stream import StreamConfig, StreamSetupError
from narrows.stream.config import RENAMED


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpu_budget", "twelve gigs"),
        ("gpu_budget", -1),
        ("batch_size", 0),
        ("seq_len", 2.5),
        ("prefetch_depth", -1),
        ("prefetch_depth", True),
        ("head", "chunked"),
        ("head_rows", 0),
        ("offload_inputs", "some"),
        ("seq_tile", 0),
        ("seq_tile", True),
        ("recompute", "sometimes"),
        ("graphs", "yes"),
        ("reserve", -5),
        ("reserve", 1.5),
        ("host_state", "gpu"),
        ("check", "yes"),
        ("inference", 1),
        ("deterministic", None),
    ],
)
def test_each_bad_value_is_refused_naming_its_field(field, value):
    with pytest.raises(StreamSetupError, match=f"^{field}="):
        StreamConfig(**{field: value})
    # the same refusal, whichever way the setting comes in
    with pytest.raises(StreamSetupError, match=f"^{field}="):
        ns.plan(build(), **{field: value})


def test_every_default_is_valid_and_the_config_is_frozen():
    c = StreamConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seq_len = 4  # type: ignore[misc]
    assert c.replace(seq_len=64).seq_len == 64 and c.seq_len == 512
    with pytest.raises(StreamSetupError, match=r"^seq_len="):
        c.replace(seq_len=0)


def test_the_old_keyword_names_are_taken_and_a_setting_given_twice_is_refused():
    assert RENAMED == {"offload": "offload_inputs", "prefetch": "prefetch_depth"}
    c = StreamConfig.of("1GiB", offload="all", prefetch=2)
    assert (c.gpu_budget, c.offload_inputs, c.prefetch_depth) == ("1GiB", "all", 2)
    with pytest.raises(StreamSetupError, match="offload= and offload_inputs="):
        StreamConfig.of(offload="all", offload_inputs="off")
    with pytest.raises(StreamSetupError, match="budget is given twice"):
        StreamConfig.of("1GiB", gpu_budget="2GiB")
    with pytest.raises(StreamSetupError, match="unknown stream setting seqlen: StreamConfig takes"):
        StreamConfig.of(seqlen=4)
    base = StreamConfig(seq_len=64)
    assert StreamConfig.of(base) is base
    assert StreamConfig.of(base, offload="off").offload_inputs == "off"


def test_config_and_keywords_plan_alike():
    """A config object and the same settings as keywords give the same plan; a setting
    the keywords change (offloading) changes it, so the comparison can fail."""
    model = build(num_hidden_layers=5)
    kw = dict(device="cpu", batch_size=2, seq_len=12, prefetch=2, offload="off", recompute="all")
    cfg = StreamConfig(
        device="cpu", batch_size=2, seq_len=12, prefetch_depth=2, offload_inputs="off", recompute="all"
    )
    assert ns.plan(model, None, **kw) == ns.plan(model, cfg)
    assert ns.plan(model, cfg) != ns.plan(model, cfg.replace(offload_inputs="all"))


def test_the_handle_keeps_the_config_and_replans_with_it():
    """``model.narrows_stream.config`` is what the model was streamed with (device
    resolved); a replan with other rates keeps every setting and the resolved budget."""
    model = build(num_hidden_layers=5)
    cfg = StreamConfig(device="cpu", batch_size=2, seq_len=12, offload_inputs="all", prefetch_depth=2)
    ns.stream(model, cfg)
    handle = model.narrows_stream
    assert handle.config == cfg.replace(device=torch.device("cpu"))
    again = handle.replan(ns.Rates())
    assert again == handle.plan
    assert again.offloaded == handle.plan.offloaded == tuple(range(5)) and again.prefetch == 2


def test_streamed_with_a_config_trains_as_with_keywords():
    """The config path trains the same bits as the keyword path (both streamed, CPU)."""
    a, b = build(), build()
    ns.stream(a, StreamConfig(device="cpu", offload_inputs="all", prefetch_depth=0))
    ns.stream(b, device="cpu", offload="all", prefetch=0)
    got, want = train(a), train(b)
    assert got.keys() == want.keys()
    for key in want:
        assert all(torch.equal(x, y) for x, y in zip(got[key], want[key], strict=True)), key
