"""benchmarks/bench_offload_ab.py: its variants as offload keys, and the paired rounds' summary."""
import pytest

from benchmarks.bench_offload_ab import summary, variant
from engine.offload.config import OffloadConfigError


def test_a_variant_is_the_offload_keys_it_names_in_short_or_full_form():
    assert variant("") == {}
    assert variant("cpu_threads=15,placement=static") == {"cpu_threads": 15, "placement": "static"}
    assert variant("session.moe.offload.cpu_execution=disabled") == {"cpu_execution": "disabled"}
    with pytest.raises(OffloadConfigError, match="unknown offload key 'threads'"):
        variant("threads=4")
    with pytest.raises(SystemExit, match="set by --fractions"):
        variant("device_expert_bytes=1000")


def test_the_summary_pairs_each_round_of_b_with_the_round_of_a_beside_it():
    result = summary({"A": [10.0, 20.0, 30.0], "B": [11.0, 18.0, 36.0]})
    assert result["a_median"] == 20.0 and result["b_median"] == 18.0
    assert result["ratio_min"] == pytest.approx(0.9) and result["ratio_max"] == pytest.approx(1.2)
    assert result["ratio_median"] == pytest.approx(1.1)  # per-round ratios 1.1, 0.9, 1.2: not 18 / 20
