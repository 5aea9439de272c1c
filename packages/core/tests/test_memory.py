import pytest
import torch

from narrows.core import format_bytes, measure_peaks, parse_bytes, read_peaks


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GiB", 12 * 2**30),
        ("800MiB", 800 * 2**20),
        ("16GB", 16 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("1073741824", 2**30),
        (4096, 4096),
        ("2kib", 2048),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["twelve", "12 parsecs", "", "-3GiB"])
def test_parse_bytes_says_what_it_expects(bad):
    with pytest.raises(ValueError, match="12GiB"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12 * 2**30) == "12 GiB"
    assert format_bytes(1023.7 * 2**20) == "1 GiB"  # not "1e+03 MiB"
    assert not [n for n in range(0, 1 << 24, 997) if "e+" in format_bytes(n * 1024.37)]


def test_host_peak_sees_an_allocation():
    with measure_peaks("cpu") as before:
        pass
    with measure_peaks("cpu") as p:
        x = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
        x += 1
    assert p.host_rss >= before.host_rss
    assert p.host_rss > 64 * 2**20
    assert p.device == "cpu" and p.cuda_allocated == 0
    del x


@pytest.mark.gpu
def test_cuda_peaks_see_an_allocation():
    with measure_peaks("cuda") as p:
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        del x
    assert p.cuda_allocated >= 256 * 2**20 and p.cuda_reserved >= p.cuda_allocated
    assert read_peaks("cuda").device.startswith("cuda")
