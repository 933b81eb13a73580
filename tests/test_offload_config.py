"""The offload configuration reads every value as onnxruntime 1.32 does: what it accepts is accepted and means the
same, what it refuses is refused in one line naming the key, the value and what is wrong."""

import pytest

from engine.offload.config import FLOAT32_MAX, PREFIX, NodeOverride, OffloadConfig, OffloadConfigError
from tests.conftest import fixture_folder


def parsed(key: str, value: str):
    return getattr(OffloadConfig.from_entries({key: value}), key)


def refusal(key: str, value: str) -> str:
    with pytest.raises(OffloadConfigError) as error:
        OffloadConfig.from_entries({key: value})
    return str(error.value)


# (key, value) pairs whose fate onnxruntime 1.32 decides one way or the other
INTEGERS = [("device_expert_bytes", value) for value in (
    "0", "0100", "18446744073709551615", "18446744073709551616", "+100", "1_000", " 100", "100 ", "-0", "1e9",
    "\u0661\u0660\u0660")] + [
    ("gpu_device_mem_limit", "18446744073709551615"), ("gpu_device_mem_limit", "18446744073709551616"),
    ("device_working_bytes", "0"), ("host_working_bytes", "18446744073709551616"),
    ("cpu_threads", "2147483647"), ("cpu_threads", "2147483648"), ("cpu_threads", "+1"),
    ("async_max_tokens", "2147483648"), ("prefill_wave_experts", "2147483648"),
    ("tail_substitution_min_rank", "2147483648"), ("tail_substitution_min_rank", "01"),
    ("node_overrides", "n:max_resident_slots=2147483648"), ("node_overrides", "n:max_resident_slots=+1"),
    ("node_overrides", "n:device_expert_bytes=18446744073709551615"),
    ("node_overrides", "n:device_expert_bytes=18446744073709551616"),
]

WORDS = [("mode", value) for value in ("Auto", "REQUIRED", "Disabled", "0", "1", "on", "OFF", "true", "2", "none",
                                       "enabled")] + [
    ("placement", "Static"), ("placement", "ADAPTIVE"), ("placement", "1"), ("placement", "dynamic"),
    ("cpu_execution", "Enabled"), ("cpu_execution", "0"), ("cpu_execution", "1"), ("cpu_execution", "on"),
    ("device_expert_bytes", "AUTO"), ("reserve_device_bytes", "Auto"), ("gpu_device_mem_limit", "auto"),
    ("allow_file_backing", "true"), ("allow_file_backing", "FALSE"), ("allow_file_backing", "yes"),
    ("allow_file_backing", "01"), ("skip_tail_cold_only", "true"), ("skip_zero_cold_doorbell", "False"),
]

FLOATS = [("min_expert_weight", value) for value in (
    "0", "1", "1.0001", "1.00000001", ".5", "5e-1", " 0.5", "0.5 ", "\t0.5", "+0.5", "-0", "-1e-50", "1e-400", "1_0",
    "0x0.8p0", "0X0.8P0", "nan", "inf", "0.5x", "0.5e", ".")] + [
    ("tail_substitution_threshold", value) for value in (
        "0", "-0.0", ".5", "5.", "1E5", "1e10", "3.40282356e38", "3.4028236e38", "1e39", "1e400", "inf", "infinity",
        "nan", "1e-45", "1e-46", "1e-400", "-1e-400", "-1", "+1", " 1", "1 ", "1_0", "0x10")]

TEXTS = [(key, "") for key in ("popularity_file", "budget_group", "source_root", "derived_cache_dir")] + [
    ("node_overrides", value) for value in (
        "", " ", ";", "n:max_resident_slots=1;", " n : max_resident_slots = 1 ", "n:max_resident_slots=1,",
        "n:max_resident_slots=1,device_expert_bytes=5", "a:b:max_resident_slots=1", "n:", "n:,", "n",
        ":max_resident_slots=1", "n:max_resident_slots=1,,device_expert_bytes=2", "n:max_resident_slots=",
        "n:device_expert_bytes=auto", "N:MAX_RESIDENT_SLOTS=1")]


def onnxruntime_accepts(key: str, value: str) -> bool:
    """Whether onnxruntime's own session creation takes the entry (its validation of session.moe.offload.*)."""
    return onnxruntime_takes({PREFIX + key: value})


def onnxruntime_takes(entries: dict[str, str]) -> bool:
    ort = pytest.importorskip("onnxruntime")
    if tuple(int(part) for part in ort.__version__.split(".")[:2]) < (1, 32):
        pytest.skip(f"onnxruntime {ort.__version__} predates the session.moe.offload keys (1.32)")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    try:
        ort.InferenceSession(str(fixture_folder("gptoss") / "model.onnx"), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime's refusal, whatever its class
        assert "session.moe.offload" in str(exc), exc
        return False
    return True


def we_accept(key: str, value: str) -> bool:
    try:
        OffloadConfig.from_entries({key: value})
    except OffloadConfigError:
        return False
    return True


@pytest.mark.parametrize("key, value", INTEGERS + WORDS + FLOATS + TEXTS)
def test_we_accept_what_onnxruntime_accepts(key, value):
    assert we_accept(key, value) == onnxruntime_accepts(key, value)


def test_integers_are_digits_alone_within_onnxruntimes_ranges():
    assert parsed("device_expert_bytes", "0100") == 100
    assert parsed("device_expert_bytes", "18446744073709551615") == 2**64 - 1
    assert refusal("device_expert_bytes", "+100") == ("session.moe.offload.device_expert_bytes='+100': expected an "
                                                      "integer >= 0, in digits only")
    assert refusal("device_expert_bytes", "1_000").endswith("expected an integer >= 0, in digits only")
    assert refusal("cpu_threads", "2147483648") == ("session.moe.offload.cpu_threads='2147483648': expected an "
                                                    "integer from 0 to 2147483647")
    assert refusal("gpu_device_mem_limit", str(2**64)).endswith(f"expected an integer from 0 to {2**64 - 1}")
    assert refusal("node_overrides", "n:max_resident_slots=2147483648").endswith("from 0 to 2147483647")


def test_spaces_around_a_value_are_refused_as_onnxruntime_refuses_them():
    assert refusal("device_expert_bytes", " 100") == ("session.moe.offload.device_expert_bytes=' 100': expected an "
                                                      "integer >= 0, in digits only (onnxruntime refuses spaces "
                                                      "around the value)")
    assert refusal("mode", "auto ").endswith("(onnxruntime refuses spaces around the value)")


def test_words_are_read_in_any_case_and_onnxruntimes_other_spellings_mean_what_they_mean_there():
    assert parsed("mode", "REQUIRED") == "required" and parsed("placement", "Static") == "static"
    assert [parsed("mode", value) for value in ("0", "off", "1", "On")] == ["disabled", "disabled", "required",
                                                                           "required"]
    assert [parsed("cpu_execution", value) for value in ("0", "1", "ENABLED")] == ["disabled", "enabled", "enabled"]
    assert parsed("device_expert_bytes", "AUTO") is None
    assert parsed("allow_file_backing", "False") is False and parsed("allow_file_backing", "TRUE") is True
    assert refusal("skip_tail_cold_only", "true") == "session.moe.offload.skip_tail_cold_only='true': expected 0 or 1"
    # held as the word itself, so that an export says what it means
    assert OffloadConfig.from_entries({"mode": "1"}).to_entries() == {PREFIX + "mode": "required"}


def test_the_two_floats_are_read_as_onnxruntime_reads_each():
    assert parsed("min_expert_weight", " 0x0.8p0 ") == 0.5 and parsed("min_expert_weight", "+.25") == 0.25
    assert refusal("min_expert_weight", "1_0") == "session.moe.offload.min_expert_weight='1_0': expected a number in " \
                                                  "[0.0, 1.0]"
    assert parsed("tail_substitution_threshold", "1e-45") == 1e-45
    assert refusal("tail_substitution_threshold", "inf") == ("session.moe.offload.tail_substitution_threshold='inf': "
                                                             "expected a number >= 0.0 in decimal digits (no '+' or "
                                                             "spaces)")
    assert refusal("tail_substitution_threshold", "1e39").endswith("beyond a 32-bit float's range (1.4e-45 to 3.4e38)")
    assert refusal("tail_substitution_threshold", "1e-400").endswith("beyond a 32-bit float's range (1.4e-45 to 3.4e38)")
    assert refusal("tail_substitution_threshold", "-1").endswith("expected a number >= 0.0")


def test_an_empty_name_or_path_is_unset_and_node_overrides_split_as_onnxruntime_splits_them():
    assert parsed("popularity_file", "") is None and parsed("budget_group", "") is None
    overrides = parsed("node_overrides", " /model/layers.0/moe/QMoE : max_resident_slots = 2 ,")
    assert list(overrides) == ["/model/layers.0/moe/QMoE"] and overrides["/model/layers.0/moe/QMoE"].max_resident_slots == 2
    assert refusal("node_overrides", "a:b:max_resident_slots=1") == (
        "session.moe.offload.node_overrides='a:b:max_resident_slots=1': 'b:max_resident_slots=1' in "
        "'a:b:max_resident_slots=1': expected max_resident_slots=N or device_expert_bytes=B")


def test_a_node_or_a_limit_given_twice_in_node_overrides_is_refused_naming_both():
    """onnxruntime 1.32 takes a node named twice without saying which entry wins (offload-keys.md does not say
    either); the later one silently replaced the earlier here, so a limit the user wrote was dropped unseen."""
    assert refusal("node_overrides", "n:max_resident_slots=1; n : device_expert_bytes=2") == (
        "session.moe.offload.node_overrides='n:max_resident_slots=1; n : device_expert_bytes=2': node 'n' is named "
        "twice: 'n:max_resident_slots=1' and 'n : device_expert_bytes=2'")
    assert refusal("node_overrides", "n:max_resident_slots=1,max_resident_slots=2") == (
        "session.moe.offload.node_overrides='n:max_resident_slots=1,max_resident_slots=2': max_resident_slots is "
        "given twice in 'n:max_resident_slots=1,max_resident_slots=2'")
    # node names are case-sensitive
    assert list(parsed("node_overrides", "n:max_resident_slots=1;N:max_resident_slots=2")) == ["n", "N"]


def test_two_names_of_one_setting_must_agree_as_onnxruntime_requires():
    with pytest.raises(OffloadConfigError) as error:
        OffloadConfig.from_entries({PREFIX + "device_expert_bytes": "1000", PREFIX + "gpu_budget_bytes": "2000"})
    assert str(error.value) == ("conflicting values for one setting: session.moe.offload.device_expert_bytes='1000' "
                                "and session.moe.offload.gpu_budget_bytes='2000'")
    agreed = OffloadConfig.from_entries({"device_expert_bytes": "1000", PREFIX + "gpu_budget_bytes": "01000",
                                         "mode": "required", PREFIX + "mode": "ON"})
    assert agreed.device_expert_bytes == 1000 and agreed.mode == "required"


@pytest.mark.parametrize("config", [
    OffloadConfig(),
    OffloadConfig(mode="required", placement="static", cpu_execution="disabled", device_expert_bytes=0,
                  gpu_device_mem_limit=2**64 - 1, device_working_bytes=1, allow_file_backing=False, cpu_threads=3,
                  node_overrides={"n": NodeOverride(1, 2)}, popularity_file="/p.json", min_expert_weight=1e-05,
                  skip_tail_cold_only=True, tail_substitution_threshold=3.4e38, tail_substitution_min_rank=0)])
def test_the_exported_session_entries_write_every_setting_in_a_form_onnxruntime_takes(config):
    entries = config.session_entries()
    assert onnxruntime_takes(entries) and OffloadConfig.from_entries(entries) == config
    assert entries[PREFIX + "async_max_tokens"] == str(config.async_max_tokens)  # defaults written out too
    assert (PREFIX + "popularity_file" in entries) == (config.popularity_file is not None)


def test_an_unknown_key_near_the_alias_is_pointed_to_it():
    assert refusal("session.moe.offload.gpu_budget_byte", "5") == ("unknown offload key "
                                                                   "'session.moe.offload.gpu_budget_byte': did you mean "
                                                                   "'gpu_budget_bytes'?")
    assert "gpu_budget_bytes" in refusal("turbo", "1")  # among the known names


@pytest.mark.parametrize("given", ["1e-50", "1e-46", "-1e-50", "-0"])
def test_a_min_expert_weight_that_a_32_bit_float_reads_as_zero_is_off_as_there(given):
    """onnxruntime reads min_expert_weight into a 32-bit float: 1e-50 (an underflow strtof reads as 0) is 0 there,
    approximate routing off, where this engine held 1e-50, counted routing as approximate (a shadow pass, records
    saying 'approximate') and wrote '1e-50' back."""
    config = OffloadConfig.from_entries({"min_expert_weight": given})
    assert config.min_expert_weight == 0.0 and str(config.min_expert_weight) == "0.0"
    assert not OffloadConfig.from_entries({"min_expert_weight": given, "mode": "auto"}).approximate_routing
    assert config.to_entries() == {} and config.session_entries()[PREFIX + "min_expert_weight"] == "0.0"
    assert parsed("min_expert_weight", "1e-45") == 1e-45  # the smallest 32-bit float stays itself
    assert str(parsed("tail_substitution_threshold", "-0.0")) == "0.0"


def test_a_float_past_its_bound_that_a_32_bit_float_reads_as_the_bound_is_held_as_the_bound():
    """'1.00000001' is 1.0 as onnxruntime's 32-bit float and '3.40282356e38' the largest one: both are taken there.
    Held as given, they were written back as given and the Budgets panel, whose boxes stop at the bound, gave 1.0
    back: a change nobody made (a configuration 'not applied yet' after Apply)."""
    assert parsed("min_expert_weight", "1.00000001") == 1.0
    assert parsed("tail_substitution_threshold", "3.40282356e38") == FLOAT32_MAX == 3.4028234663852886e38
    written = OffloadConfig.from_entries({"tail_substitution_threshold": "3.40282356e38"}).to_entries()
    assert written == {PREFIX + "tail_substitution_threshold": "3.4028234663852886e+38"}
    assert onnxruntime_takes(written)


def test_a_key_of_the_offload_prototype_is_pointed_to_its_name_in_1_32():
    """session.moe.cpu_offload.* (the prototype's prefix, which onnxruntime 1.32 discards: 'Prototype configuration
    key ... use session.moe.offload.*') was refused as unknown with the list of every known name."""
    assert refusal("session.moe.cpu_offload.mode", "auto") == (
        "unknown offload key 'session.moe.cpu_offload.mode': the offload prototype's prefix, which onnxruntime 1.32 "
        "discards; its name now is 'session.moe.offload.mode'")
    assert refusal("session.moe.cpu_offload.turbo", "1") == (
        "unknown offload key 'session.moe.cpu_offload.turbo': the offload prototype's prefix, which onnxruntime 1.32 "
        "discards; session.moe.offload.* has no 'turbo'")


def test_a_bad_number_in_node_overrides_names_the_node_and_the_limit_it_was_given_for():
    """node_overrides holds several numbers: a refusal of one said only 'expected an integer >= 0, in digits only'
    after the whole list, not which node's which limit was wrong."""
    assert refusal("node_overrides", "a:max_resident_slots=1;b:max_resident_slots=x,device_expert_bytes=5") == (
        "session.moe.offload.node_overrides='a:max_resident_slots=1;b:max_resident_slots=x,device_expert_bytes=5': "
        "'max_resident_slots=x' in 'b:max_resident_slots=x,device_expert_bytes=5': expected an integer >= 0, in "
        "digits only")
    assert refusal("node_overrides", "a: device_expert_bytes = -1").endswith(
        "'device_expert_bytes = -1' in 'a: device_expert_bytes = -1': expected an integer >= 0, in digits only")


def test_a_byte_count_with_a_unit_is_refused_as_onnxruntime_refuses_it_saying_its_bytes():
    """onnxruntime takes byte counts as digits alone, so '2GiB' is refused; the refusal said only 'in digits only',
    though the window's budgets and --simulated-vram take units: it now gives the count to write."""
    assert not we_accept("device_expert_bytes", "2GiB")
    assert refusal("device_expert_bytes", "2GiB") == (
        "session.moe.offload.device_expert_bytes='2GiB': expected an integer >= 0, in digits only (onnxruntime "
        "takes a byte count without a unit: 2GiB is 2147483648)")
    assert refusal("pinned_bytes", "1.5 MiB").endswith("(onnxruntime takes a byte count without a unit: 1.5 MiB is "
                                                       "1572864)")
    assert refusal("node_overrides", "n:device_expert_bytes=64M").endswith(
        "expected an integer >= 0, in digits only (onnxruntime takes a byte count without a unit: 64M is 67108864)")
    # not a size, or not a byte count: no such hint
    assert refusal("device_expert_bytes", "lots").endswith("in digits only")
    assert refusal("cpu_threads", "4k").endswith("in digits only")
