"""genai_config.json as the model builder writes it: every field read with its defaults, a bad value named."""

from __future__ import annotations

import json

import pytest

from engine.errors import ModelFileError
from engine.genai_config import load_genai_config
from engine.sampling import describe, model_sampling


def edited(copy_fixture, name: str, edit):
    return rewritten(copy_fixture(name), edit)


def rewritten(folder, edit, original: dict | None = None):
    """`folder` with its genai_config.json (or `original`) changed by `edit`."""
    config = json.loads(json.dumps(original)) if original else json.loads((folder / "genai_config.json").read_text())
    edit(config)
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def test_search_settings_written_as_null_take_the_defaults(copy_fixture):
    # the builder run with transformers 5, whose GenerationConfig leaves unset settings None, writes null
    def nulls(config):
        config["search"].update(do_sample=None, temperature=None, top_k=None, top_p=None, repetition_penalty=None,
                                past_present_share_buffer=None)
        config["search"].update(max_length=None, min_length=None)

    search = load_genai_config(edited(copy_fixture, "gptoss", nulls)).search
    assert (search.do_sample, search.temperature, search.top_k, search.top_p, search.repetition_penalty,
            search.max_length, search.min_length) == (False, 1.0, 50, 1.0, 1.0, 2048, 0)


def test_search_settings_of_the_wrong_type_are_named(copy_fixture):
    folder = edited(copy_fixture, "gptoss", lambda c: c["search"].update(do_sample="false", temperature=0.7))
    with pytest.raises(ModelFileError, match=r"genai_config.json: 'search.do_sample' is \"false\", not true or false"):
        load_genai_config(folder)
    folder = edited(copy_fixture, "lfm2moe", lambda c: c["search"].update(temperature="warm"))
    with pytest.raises(ModelFileError, match=r"genai_config.json: 'search.temperature' is \"warm\", not a number"):
        load_genai_config(folder)


def test_model_sampling_reads_the_search_section(copy_fixture):
    folder = edited(copy_fixture, "qwen35moe",
                    lambda c: c["search"].update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95))
    params = model_sampling(load_genai_config(folder))
    assert (params.do_sample, params.temperature, params.top_k, params.top_p) == (True, 0.6, 20, 0.95)


def _sliding_slots(folder) -> dict[str, bool]:
    from engine.decoder_state import DecoderState
    from engine.onnx_file import OnnxFile

    config = load_genai_config(folder)
    state = DecoderState(config, OnnxFile(folder / config.filename).proto.graph)
    return {slot.past_name: slot.sliding for slot in state.slots if slot.shared}


def test_a_sliding_window_that_lists_no_layers_applies_to_every_layer(copy_fixture):
    folder = copy_fixture("gptoss")
    original = json.loads((folder / "genai_config.json").read_text())
    assert _sliding_slots(folder) == {  # the builder's list: layer 0 only
        "past_key_values.0.key": True, "past_key_values.0.value": True,
        "past_key_values.1.key": False, "past_key_values.1.value": False}
    for unlisted in ({}, {"layers": None}, {"layers": []}):
        def edit(config, unlisted=unlisted):
            config["model"]["decoder"]["sliding_window"].pop("layers")
            config["model"]["decoder"]["sliding_window"].update(unlisted)

        # onnxruntime-genai's uniform window (kv_cache.cpp: no layers listed, every layer's cache is the window)
        assert set(_sliding_slots(rewritten(folder, edit, original)).values()) == {True}, unlisted


def test_sliding_window_layers_that_are_not_indices_are_named(copy_fixture):
    folder = copy_fixture("gptoss")
    original = json.loads((folder / "genai_config.json").read_text())
    for layers in ("0", ["a"], [0, -1], {"0": 1}):
        rewritten(folder, lambda c, layers=layers: c["model"]["decoder"]["sliding_window"].update(layers=layers),
                  original)
        with pytest.raises(ModelFileError, match=r"genai_config.json: 'model.decoder.sliding_window.layers' is .*, "
                                                 r"not a list of layer indices"):
            load_genai_config(folder)


def test_bos_and_pad_token_ids_are_token_ids_or_null(copy_fixture):
    folder = copy_fixture("lfm2moe")
    original = json.loads((folder / "genai_config.json").read_text())
    config = load_genai_config(rewritten(folder, lambda c: c["model"].update(bos_token_id=None), original))
    assert (config.bos_token_id, config.pad_token_id) == (None, 0)
    for field, value, shown in (("bos_token_id", "x", '"x"'), ("pad_token_id", [0, 1], r"\[0, 1\]"),
                                ("pad_token_id", -1, "-1"), ("bos_token_id", True, "true")):
        rewritten(folder, lambda c, field=field, value=value: c["model"].update({field: value}), original)
        with pytest.raises(ModelFileError, match=rf"genai_config.json: 'model.{field}' is {shown}, not a token id"):
            load_genai_config(folder)


def test_the_decoders_names_are_strings_a_null_one_as_if_missing(copy_fixture):
    folder = copy_fixture("gptoss")
    original = json.loads((folder / "genai_config.json").read_text())
    config = load_genai_config(rewritten(folder, lambda c: c["model"]["decoder"].update(filename=None), original))
    assert config.filename == "model.onnx"  # not 'None', a file that is not there
    for edit, field, shown in (
            (lambda c: c["model"]["decoder"].update(filename=["model.onnx"]), "model.decoder.filename",
             r'\["model.onnx"\]'),
            (lambda c: c["model"]["decoder"]["inputs"].update(input_ids=5), "model.decoder.inputs.input_ids", "5"),
            (lambda c: c["model"]["decoder"]["outputs"].update(logits={"name": "logits"}),
             "model.decoder.outputs.logits", r'\{"name": "logits"\}')):
        rewritten(folder, edit, original)
        with pytest.raises(ModelFileError, match=rf"genai_config.json: '{field}' is {shown}, not a string"):
            load_genai_config(folder)


def test_model_sampling_takes_the_search_sections_random_seed(copy_fixture):
    folder = edited(copy_fixture, "gptoss", lambda c: c["search"].update(do_sample=True, random_seed=42))
    assert model_sampling(load_genai_config(folder)).seed == 42
    for unseeded in (-1, None):  # onnxruntime-genai's -1: a fresh seed each time
        rewritten(folder, lambda c, seed=unseeded: c["search"].update(random_seed=seed))
        assert model_sampling(load_genai_config(folder)).seed is None
    rewritten(folder, lambda c: c["search"].update(random_seed=-2))
    with pytest.raises(ModelFileError, match=r"'search.random_seed' is -2, less than -1"):
        load_genai_config(folder)
    # a seed a sampled record could not keep in the history (SQLite's 64-bit integers): refused with the file's name,
    # not an internal error once the run was measured
    rewritten(folder, lambda c: c["search"].update(random_seed=2**63))
    with pytest.raises(ModelFileError, match=r"'search.random_seed' is 9223372036854775808, more than "
                                             r"9223372036854775807"):
        load_genai_config(folder)


def test_a_search_section_with_top_p_0_loads_and_samples_as_onnxruntime_genai_does(copy_fixture):
    folder = edited(copy_fixture, "gptoss", lambda c: c["search"].update(do_sample=True, top_k=40, top_p=0.0))
    params = model_sampling(load_genai_config(folder))
    assert (params.top_k, params.top_p, describe(params)) == (40, 0.0, "temperature 1, top-k 40")


def test_the_decoders_provider_options_are_not_read(copy_fixture):
    # the engine chooses its own execution providers (engine/ort_env.py): session_options.provider_options, which
    # the builder writes for its target (cuda, dml, ...), is left to onnxruntime-genai, whatever it holds
    folder = copy_fixture("gptoss")
    for value in (5, None, "cuda", [{"cuda": {}}]):
        rewritten(folder, lambda c, v=value: c["model"]["decoder"].setdefault("session_options", {}).update(
            provider_options=v))
        assert load_genai_config(folder).context_length == 2048
