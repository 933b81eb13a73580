"""Every key of onnxruntime 1.32's offload vocabulary (shared/reference/offload-keys.md), walked from one table: its
default, and for each value written the way a user may write it, what it is held as and the form every output
(inspect's session_config_entries, records, saved configurations) writes back, which must read again to the same
setting and be taken by onnxruntime itself."""

import re

import pytest

from engine.offload.config import PREFIX, NodeOverride, OffloadConfig
from tests.conftest import REPO
from tests.test_offload_config import onnxruntime_takes

# key: (default held, default as session_entries writes it (None: left out),
#       [(value as given, held as, written back as)])
# The reference states the defaults of placement (adaptive), gpu_device_mem_limit (0, no limit), the byte budgets that
# take 'auto' and approximate routing (off); the others are this engine's, written out by session_entries so that a
# configuration copied out means the same there whatever onnxruntime's own default is.
VOCABULARY = {
    "mode": ("auto", "auto", [
        ("disabled", "disabled", "disabled"), ("auto", "auto", "auto"), ("required", "required", "required"),
        ("Required", "required", "required"), ("1", "required", "required"), ("off", "disabled", "disabled")]),
    "placement": ("adaptive", "adaptive", [
        ("static", "static", "static"), ("ADAPTIVE", "adaptive", "adaptive")]),
    "cpu_execution": ("auto", "auto", [
        ("enabled", "enabled", "enabled"), ("disabled", "disabled", "disabled"), ("1", "enabled", "enabled"),
        ("0", "disabled", "disabled")]),
    "device_expert_bytes": (None, "auto", [
        ("auto", None, "auto"), ("AUTO", None, "auto"), ("0", 0, "0"), ("0100", 100, "100"),
        ("18446744073709551615", 2**64 - 1, "18446744073709551615")]),
    "reserve_device_bytes": (None, "auto", [("auto", None, "auto"), ("1073741824", 1 << 30, "1073741824")]),
    "gpu_device_mem_limit": (0, "0", [("0", 0, "0"), ("8589934592", 8 << 30, "8589934592")]),
    "host_expert_bytes": (None, "auto", [("Auto", None, "auto"), ("0", 0, "0"), ("4096", 4096, "4096")]),
    "pinned_bytes": (None, "auto", [("auto", None, "auto"), ("1048576", 1 << 20, "1048576")]),
    "device_working_bytes": (None, None, [("1", 1, "1"), ("67108864", 64 << 20, "67108864")]),
    "host_working_bytes": (None, None, [("1", 1, "1")]),
    "allow_file_backing": (True, "1", [
        ("0", False, "0"), ("1", True, "1"), ("true", True, "1"), ("FALSE", False, "0")]),
    "cpu_threads": (0, "0", [("0", 0, "0"), ("4", 4, "4"), ("2147483647", 2**31 - 1, "2147483647")]),
    "async_max_tokens": (8, "8", [("0", 0, "0"), ("64", 64, "64")]),
    "prefill_wave_experts": (8, "8", [("1", 1, "1"), ("32", 32, "32")]),
    "node_overrides": ({}, None, [
        ("n:max_resident_slots=2,device_expert_bytes=5", {"n": NodeOverride(2, 5)},
         "n:max_resident_slots=2,device_expert_bytes=5"),
        (" n : max_resident_slots = 2 ,", {"n": NodeOverride(2)}, "n:max_resident_slots=2"),
        ("a:device_expert_bytes=0;b:max_resident_slots=0;", {"a": NodeOverride(None, 0), "b": NodeOverride(0)},
         "a:device_expert_bytes=0;b:max_resident_slots=0"),
        ("", {}, None)]),
    "popularity_file": (None, None, [("/data/pop.json", "/data/pop.json", "/data/pop.json"), ("", None, None)]),
    "budget_group": (None, None, [("shared", "shared", "shared")]),
    "source_root": (None, None, [("/weights", "/weights", "/weights")]),
    "derived_cache_dir": (None, None, [("/cache", "/cache", "/cache")]),
    "min_expert_weight": (0.0, "0.0", [
        ("0", 0.0, "0.0"), ("0.05", 0.05, "0.05"), ("1", 1.0, "1.0"), ("+.25", 0.25, "0.25"),
        ("0x0.8p0", 0.5, "0.5"), ("1e-45", 1e-45, "1e-45"), ("1e-50", 0.0, "0.0"), ("-0", 0.0, "0.0")]),
    "skip_tail_cold_only": (False, "0", [("0", False, "0"), ("1", True, "1")]),
    "skip_zero_cold_doorbell": (False, "0", [("1", True, "1")]),
    "tail_substitution_threshold": (0.0, "0.0", [
        ("0", 0.0, "0.0"), ("0.5", 0.5, "0.5"), ("1E5", 1e5, "100000.0"), ("1e-45", 1e-45, "1e-45"),
        ("3.4e38", 3.4e38, "3.4e+38")]),
    "tail_substitution_min_rank": (1, "1", [("0", 0, "0"), ("3", 3, "3")]),
}
ALIASES = {"gpu_budget_bytes": "device_expert_bytes"}
SAMPLES = [(key, *sample) for key, (_, _, samples) in VOCABULARY.items() for sample in samples]


def test_the_table_walks_every_key_of_the_reference():
    reference = REPO.parent / "shared" / "reference" / "offload-keys.md"
    if not reference.is_file():
        pytest.skip(f"{reference} is not present")
    rows = [line.split("|")[1] for line in reference.read_text().splitlines() if line.startswith("| ")][1:]
    named = {name for row in rows for name in re.findall(r"[a-z_]+", row)} - {"alias"}
    assert named == set(VOCABULARY) | set(ALIASES)


@pytest.mark.parametrize("key", VOCABULARY)
def test_the_defaults(key):
    default, written, _ = VOCABULARY[key]
    assert getattr(OffloadConfig(), key) == default
    assert OffloadConfig().session_entries().get(PREFIX + key) == written
    assert PREFIX + key not in OffloadConfig().to_entries()


def test_the_default_configuration_as_written_out_is_taken_by_onnxruntime_and_reads_again_the_same():
    entries = OffloadConfig().session_entries()
    assert OffloadConfig.from_entries(entries) == OffloadConfig()
    assert onnxruntime_takes(entries)


@pytest.mark.parametrize("key, given, held, written", SAMPLES)
@pytest.mark.parametrize("name", ["short", "full"])
def test_a_value_reads_prints_and_reads_again_the_same(key, given, held, written, name):
    config = OffloadConfig.from_entries({(PREFIX + key if name == "full" else key): given})
    assert getattr(config, key) == held
    entries = config.session_entries()
    assert entries.get(PREFIX + key) == written
    assert OffloadConfig.from_entries(entries) == config
    assert OffloadConfig.from_entries(config.to_entries()) == config
    assert all(value == value.strip() and key.startswith(PREFIX) for key, value in entries.items())


@pytest.mark.parametrize("key, given, held, written", [sample for sample in SAMPLES if sample[3] is not None])
def test_what_we_write_back_onnxruntime_takes(key, given, held, written):
    assert onnxruntime_takes({PREFIX + key: written})


def test_the_alias_is_read_as_its_setting_and_written_back_under_the_full_name():
    config = OffloadConfig.from_entries({PREFIX + "gpu_budget_bytes": "1000"})
    assert config.device_expert_bytes == 1000
    assert config.to_entries() == {PREFIX + "device_expert_bytes": "1000"}
