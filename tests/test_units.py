import pytest

from memopt.units import GiB, format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("40GB", 40 * 10**9), ("40GiB", 40 * 2**30), ("40G", 40 * 2**30), ("1.5GiB", int(1.5 * 2**30)),
     ("512MiB", 512 * 2**20), ("512MB", 512 * 10**6), (12345, 12345), ("12345", 12345), (" 8 gib ", 8 * 2**30)],
)
def test_budget_grammar(text, expected):
    assert parse_budget(text) == expected


def test_percent_of_device():
    assert parse_budget("80%", device_total_bytes=100 * GiB) == 80 * GiB
    with pytest.raises(ValueError, match="hardware"):
        parse_budget("80%")


@pytest.mark.parametrize("bad", ["40 gigs", "forty GB", "-5GB", "", "0", "150%", True])
def test_bad_budgets_name_the_grammar(bad):
    with pytest.raises(ValueError) as err:
        parse_budget(bad, device_total_bytes=GiB)
    assert "40GB" in str(err.value) or "percentage" in str(err.value) or "zero" in str(err.value)


@pytest.mark.parametrize(("fraction", "fix"), [("0.8", "'80%'"), (0.8, "'80%'"), (0.5, "'50%'"), ("1.5", "'1.5GB'")])
def test_a_unitless_fraction_is_not_read_as_one_byte(fraction, fix):
    """"0.8" meant as 80% of the device planned for 1 byte; a budget computed in floats (1.3 * 10**9) still reads."""
    with pytest.raises(ValueError, match=f"not a whole number of bytes: .*{fix}"):
        parse_budget(fraction, device_total_bytes=GiB)
    assert parse_budget(1.3 * 10**9) == 1_300_000_000 and parse_budget(2.0) == 2


def test_format_bytes():
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert format_bytes(500) == "500 B"
    assert parse_bytes("2KiB") == 2048


@pytest.mark.parametrize("tiny", ["1e-30%", "1e-12%"])
def test_a_percentage_that_rounds_to_zero_bytes_is_refused_quoting_it(tiny):
    with pytest.raises(ValueError, match=f"budget '{tiny}' is zero bytes"):
        parse_budget(tiny, device_total_bytes=80 * GiB)


@pytest.mark.parametrize(("bits", "fix"), [("40Gb", "'40GB'"), ("512Mib", "'512MiB'"), ("1.5Tb", "'1.5TB'")])
def test_a_unit_spelled_as_bits_is_refused(bits, fix):
    with pytest.raises(ValueError, match=f"means bits; for bytes write {fix}"):
        parse_budget(bits)
    assert parse_budget("40gb") == 40 * 10**9 and parse_budget("40GB") == 40 * 10**9


def test_a_float_byte_count_is_rounded_to_the_nearest_byte():
    assert parse_budget(1500.7) == 1501 and parse_bytes(2047.6) == 2048
