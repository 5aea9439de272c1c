"""narrows-dora's DoRA layers streamed by narrows-stream: bit-identical to resident."""

import pytest
from parity import assert_equal, run

import narrows.dora as nd
import narrows.stream as ns
from narrows.core.testing import tiny_model, with_adapter


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_streamed_narrows_dora_equals_resident(arch):
    def build():
        m = with_adapter(tiny_model(arch), "dora", dropout=0.05).train()
        nd.use_narrows_dora(m)
        return m

    assert_equal(run(build(), grad_accum=2), run(ns.stream(build(), device="cpu"), grad_accum=2))
