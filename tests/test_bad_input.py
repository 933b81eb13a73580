"""Bad input: one line that names the file, node or value and what is wrong; non-zero exit; no traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import onnx
import psutil
import pytest

from engine.onnx_file import OnnxFile
from engine.units import human_bytes
from tests.conftest import REPO, fixture_folder


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`python -m app ARGS` in a process of its own: for what only a process shows (its exit status, a hang); the
    other tests run the command line in this process (conftest's `cli`)."""
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True,
                          input=stdin, timeout=300)


def assert_clean_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    # (on a cold Numba cache, as a fresh clone's, `generate` says its kernels' compile before an answer fails, and on
    # a busy machine their load from the cache: a notice of the warm-up, not part of the error)
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not line.startswith(("generate: the CPU kernels compiled in ",
                                                      "generate: the CPU kernels loaded from Numba's cache in "))]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("moe-workbench: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_external_data(copy_fixture):
    """In a process: `python -m app` exits with the status main() returns and prints no traceback."""
    folder = copy_fixture("gptoss")
    (folder / "model.onnx.data").unlink()
    assert_clean_error(run_cli("inspect", str(folder)), "model.onnx.data", "missing")


def test_truncated_external_data(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert_clean_error(cli("generate", str(folder), "--prompt", "hi"), "model.onnx.data", "truncated")


def test_corrupt_model_onnx(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    raw = bytearray((folder / "model.onnx").read_bytes())
    raw[10:400] = b"\xff" * 390
    (folder / "model.onnx").write_bytes(bytes(raw))
    assert_clean_error(cli("inspect", str(folder)), "model.onnx", "not a valid ONNX model")


def test_malformed_genai_config(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    (folder / "genai_config.json").write_text('{"model": {"decoder": ')
    assert_clean_error(cli("inspect", str(folder)), "genai_config.json", "not valid JSON")


def test_genai_config_missing_key(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    del config["model"]["context_length"]
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), "genai_config.json", "context_length")


def test_malformed_tokenizer(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    assert_clean_error(cli("inspect", str(folder)), "tokenizer.json", "not a valid tokenizer")


def test_unsupported_expert_layout(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "QMoE")
    next(a for a in node.attribute if a.name == "expert_weight_bits").i = 5
    onnx.save(model, str(folder / "model.onnx"))
    result = cli("generate", str(folder), "--prompt", "hi")
    assert_clean_error(result, node.name, "bits 5")
    inspect = cli("inspect", str(folder))
    assert inspect.returncode == 1 and "UNSUPPORTED" in inspect.stdout and "bits 5" in inspect.stdout


def test_empty_prompt(cli):
    assert_clean_error(cli("generate", str(fixture_folder("gptoss")), "--prompt", "  "), "prompt is empty")


@pytest.mark.parametrize("raw", [True, False])
def test_prompt_longer_than_context(copy_fixture, cli, monkeypatch, raw):
    """Refused at once, before the kernels' warm-up, which compiled for a minute first on a cold Numba cache (and
    said so on a line of its own)."""
    import engine.kernel_warmup

    warmed = []
    monkeypatch.setattr(engine.kernel_warmup, "warm_model", lambda model: warmed.append(model) or 0.0)
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 64
    (folder / "genai_config.json").write_text(json.dumps(config))
    result = cli("generate", str(folder), *(["--raw"] if raw else []), "--prompt", "many words " * 60)
    assert_clean_error(result, "prompt has", "context is 64")
    assert warmed == []


def test_not_a_folder(tmp_path, cli):
    assert_clean_error(cli("inspect", str(tmp_path / "nowhere")), f"{tmp_path / 'nowhere'}: no such folder (point at")
    (tmp_path / "model.onnx").write_bytes(b"")
    assert_clean_error(cli("inspect", str(tmp_path / "model.onnx")), "model.onnx: not a folder (point at the folder "
                                                                    "holding genai_config.json and model.onnx)")


def test_a_folder_that_holds_model_folders_names_them(tmp_path, cli):
    """The usual first mistake with a downloaded repository (onnxruntime-genai's are laid out as
    cpu_and_mobile/cpu-int4-.../genai_config.json): the folder above the model."""
    for name in ("cuda/cuda-int4", "cpu_and_mobile/cpu-int4"):
        (tmp_path / name).mkdir(parents=True)
        shutil.copy(fixture_folder("gptoss") / "genai_config.json", tmp_path / name)
    assert_clean_error(cli("inspect", str(tmp_path)),
                       f"{tmp_path / 'genai_config.json'}: missing (a model folder from onnxruntime-genai's builder has "
                       "one; model folders in this one: cpu_and_mobile/cpu-int4, cuda/cuda-int4)")


def test_bad_sampling_value(cli):
    result = cli("generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--temperature", "0.7", "--top-p",
                     "1.5")
    assert_clean_error(result, "--top-p must be in [0, 1], got 1.5")  # the option the user typed, not the field
    result = cli("generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--temperature", "0.7", "--seed", "-5")
    assert_clean_error(result, "--seed must be >= 0, got -5")  # before the model loads (it was an internal error after)
    result = cli("generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--reasoning", "high")
    # the option typed, as the other options' errors name theirs (it said "reasoning 'high'")
    assert_clean_error(result, "error: --reasoning 'high': this model's chat template has no reasoning setting")
    result = cli("generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--raw", "--reasoning", "high")
    assert_clean_error(result, "--reasoning is a chat template setting: it does nothing with --raw")
    result = cli("generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--temperature", "nan")
    assert_clean_error(result, "--temperature must be a number >= 0, got nan")


def test_a_seed_or_top_k_the_history_cannot_keep_is_refused_before_the_model_loads(tmp_path, cli):
    """SQLite keeps 64-bit integers: record took --seed 2**64, ran, and lost the run measured to an internal error
    (OverflowError) as it saved it."""
    history = tmp_path / "history.sqlite3"
    for option in ("--seed", "--top-k"):
        result = cli("record", str(fixture_folder("gptoss")), "--history", str(history), "--temperature", "1",
                     option, str(2**64))
        assert_clean_error(result, f"{option} must be at most 9223372036854775807, got 18446744073709551616")
        assert "scenario short" not in result.stderr  # refused before it ran
    assert cli("history", "--history", str(history)).stderr.startswith("no runs saved in")
    result = cli("record", str(fixture_folder("gptoss")), "--history", str(history), "--temperature", "1", "--seed",
                 str(2**63 - 1), "--top-k", str(2**63 - 1), "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert json.loads(cli("history", "--history", str(history), "--json").stdout)[0]["generation"]["seed"] == 2**63 - 1


def test_a_count_the_history_cannot_keep_is_refused_as_the_options_are_read(tmp_path, cli):
    """record --max-new-tokens 2**64 ran and lost its run to an internal error (OverflowError) as the history saved
    its length limit; history --id 2**64 failed the same way looking it up."""
    history = tmp_path / "history.sqlite3"
    result = cli("record", str(fixture_folder("gptoss")), "--history", str(history), "--max-new-tokens", str(2**64))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "scenario short" not in result.stderr
    assert result.stderr.splitlines()[-1] == ("moe-workbench record: error: argument --max-new-tokens: "
                                              "18446744073709551616: must be at most 9223372036854775807")
    result = cli("history", "--history", str(history), "--id", str(2**64))
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        "moe-workbench history: error: argument --id: 18446744073709551616: must be at most 9223372036854775807")
    assert not history.exists()


def test_a_lost_gpu_context_is_told_in_one_line_with_what_to_do():
    """CUDA's sticky errors (the GPU context is unusable from then on) get a restart hint, from CuPy's runtime and
    driver names and onnxruntime's numbers alike; other errors and the engine's own messages stay as they are."""
    from engine.errors import GPU_LOST, WorkbenchError, one_line

    CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})
    CUDADriverError = type("CUDADriverError", (RuntimeError,), {})
    runtime = CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    assert one_line(runtime) == ("CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access was encountered; "
                                 + GPU_LOST)
    driver = CUDADriverError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure\nmore")
    assert one_line(driver) == f"CUDADriverError: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure; {GPU_LOST}"
    ort = RuntimeError("[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was encountered")
    assert one_line(ort).endswith(GPU_LOST) and "restart MoE Workbench" in GPU_LOST
    assert GPU_LOST not in one_line(CUDARuntimeError("cudaErrorMemoryAllocation: out of memory"))  # not sticky
    assert one_line(ValueError("bad value\nsecond line")) == "ValueError: bad value"
    assert one_line(WorkbenchError("model.onnx: truncated")) == "model.onnx: truncated"


def test_the_gpu_out_of_memory_says_what_to_do():
    """CuPy's OutOfMemoryError ("Out of memory allocating 268,435,456 bytes ..."), the runtime's and the driver's names
    and onnxruntime's "CUDA failure 2" were told as they came (the window's answer: "error: OutOfMemoryError: Out of
    memory allocating ..."): not that it was the GPU's memory, nor what to do. Host memory errors and other CUDA
    failures get no such hint."""
    from engine.errors import GPU_OUT_OF_MEMORY, one_line

    OutOfMemoryError = type("OutOfMemoryError", (MemoryError,), {})
    assert one_line(OutOfMemoryError("Out of memory allocating 268,435,456 bytes (allocated so far: 512 bytes).")) == (
        "OutOfMemoryError: Out of memory allocating 268,435,456 bytes (allocated so far: 512 bytes).; "
        + GPU_OUT_OF_MEMORY)
    assert GPU_OUT_OF_MEMORY == ("the GPU ran out of memory: lower the expert budget (device_expert_bytes) or free "
                                 "what other processes hold on the GPU")
    for said in (type("CUDARuntimeError", (RuntimeError,), {})("cudaErrorMemoryAllocation: out of memory"),
                 type("CUDADriverError", (RuntimeError,), {})("CUDA_ERROR_OUT_OF_MEMORY: out of memory"),
                 RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory ; "
                              "GPU=0 ; hostname=h")):
        assert one_line(said).endswith("; " + GPU_OUT_OF_MEMORY)
    for other in (MemoryError("Unable to allocate 8.00 GiB for an array"),
                  RuntimeError("[ONNXRuntimeError] : 1 : FAIL : CUDA failure 214: uncorrectable ECC error")):
        assert GPU_OUT_OF_MEMORY not in one_line(other)


def test_the_gpu_out_of_memory_under_offload_disabled_names_no_expert_budget():
    """mode=disabled puts every expert beside the dense part, where the expert budgets do not apply: the advice to
    lower device_expert_bytes changed nothing there. The mode the failing work ran under picks the advice."""
    from engine.errors import GPU_OUT_OF_MEMORY, one_line

    said = RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory ; GPU=0")
    assert one_line(said, "disabled") == (
        "RuntimeError: CUDA failure 2: out of memory ; GPU=0; the GPU ran out of memory: use mode=auto, which keeps "
        "the experts that do not fit on the CPU, or free what other processes hold on the GPU")
    for mode in ("auto", "required", None):  # the budgets apply (None: the mode is not known)
        assert one_line(said, mode).endswith("; " + GPU_OUT_OF_MEMORY)
    assert one_line(MemoryError("out of host memory"), "disabled") == "MemoryError: out of host memory"


def test_the_cli_tells_an_internal_gpu_fault_in_one_line(monkeypatch, capsys):
    import app.cli as cli

    def fault(_args):
        raise type("CUDARuntimeError", (RuntimeError,), {})("cudaErrorIllegalAddress: an illegal memory access")

    monkeypatch.setattr(cli, "_cmd_inspect", fault)
    monkeypatch.delenv("MOE_WORKBENCH_DEBUG", raising=False)
    assert cli.main(["inspect", "somewhere"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "internal error: CUDARuntimeError: cudaErrorIllegalAddress" in err
    assert err.endswith("restart MoE Workbench to use it (the CPU still works)")


def test_genai_config_fields_of_the_wrong_type_or_range_are_named(copy_fixture, cli):
    folder = copy_fixture("lfm2moe")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["num_hidden_layers"] = "two"
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), "genai_config.json",
                       "'model.decoder.num_hidden_layers' is 'two', not an integer")
    config["model"]["decoder"]["num_hidden_layers"] = 2
    config["model"]["context_length"] = -5
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), "'model.context_length' is -5, less than 1")


def _external_offset(folder, name: str) -> int:
    """Where initializer `name` starts in the folder's model.onnx.data."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    return int({entry.key: entry.value for entry in tensor.external_data}.get("offset", 0))


def test_nan_or_inf_in_expert_weights_is_named_not_a_hang_nor_a_silent_answer(copy_fixture):
    """A ZeroDivisionError that fastmath made of a NaN divisor inside a parallel kernel left its other threads
    waiting for ever (kernels.py's error_model); a NaN that reaches the logits made an empty answer."""
    import numpy as np

    folder = copy_fixture("gptoss")
    scales = _external_offset(folder, "model.layers.0.moe.experts.gate_up_proj.scales")
    for value, count in ((np.inf, 1), (np.nan, 8192)):
        with open(folder / "model.onnx.data", "r+b") as data:
            data.seek(scales)
            data.write(np.full(count, value, np.float32).tobytes())
        assert_clean_error(run_cli("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "4"),
                           str(folder), "logits that are not finite (NaN or inf)")


def test_chat_templates_that_fail_loop_or_grow_are_refused_in_one_line_naming_the_file(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    template = folder / "chat_template.jinja"
    for source, reason in (("{{ 1/0 }}", "division by zero"),
                           ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                            "still rendering after 2 s"),
                           ("{{ 'ab ' * 30000000 }}", "a * would make 90,000,000 items")):
        template.write_text(source)
        assert_clean_error(cli("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"),
                           f"{template}: chat template failed to render ({reason}")
    template.write_bytes(b"\xff\xfe{{ messages }}")
    assert_clean_error(cli("inspect", str(folder)), f"{template}: not UTF-8 text (invalid start byte at byte 0)")


def test_an_unsupported_node_shows_no_size_per_expert_it_could_not_read(copy_fixture, cli):
    """A node whose layout is not read has no expert count: its bytes per expert are unknown, not 0 B."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, lambda model: _attribute(_qmoe(model), "k", 9))
    text, as_json = cli("inspect", str(folder)), cli("inspect", str(folder), "--json")
    row = next(line for line in text.stdout.splitlines() if "UNSUPPORTED" in line)
    assert row.split()[:5] == ["0", "?", "9", "?", "252.0"]
    node = json.loads(as_json.stdout)["expert_nodes"][0]
    assert node["bytes_per_expert"] is None and node["bytes"] == 258048 and not node["supported"]


def _edit_onnx(folder, edit) -> None:
    """model.onnx rewritten after `edit(model)`; its external data stays where it is."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    edit(model)
    onnx.save(model, str(folder / "model.onnx"))


def _initializer(model, name: str):
    return next(t for t in model.graph.initializer if t.name == name)


def _set_external(tensor, key: str, value: str) -> None:
    next(entry for entry in tensor.external_data if entry.key == key).value = value


def _qmoe(model):
    return next(node for node in model.graph.node if node.op_type == "QMoE")


BIAS = "model.layers.0.moe.experts.gate_up_proj.bias"
SCALES = "model.layers.0.moe.experts.gate_up_proj.scales"
QWEIGHT = "model.layers.0.moe.experts.gate_up_proj.qweight"


def _attribute(node, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute(name, value)])


@pytest.mark.parametrize("edit, fragments", [
    (lambda m: setattr(_initializer(m, BIAS), "data_type", 0), (f"initializer '{BIAS}' has data type 0",)),
    (lambda m: _set_external(_initializer(m, QWEIGHT), "offset", "abc"),
     (f"initializer '{QWEIGHT}' has external data offset 'abc', not a number of bytes",)),
    (lambda m: _set_external(_initializer(m, QWEIGHT), "offset", "-100"), ("offset '-100', not a number of bytes",)),
    (lambda m: _attribute(_qmoe(m), "k", "two"), ("node '/model/layers.0/moe/QMoE' attribute k='two' is not an integer",)),
    (lambda m: _attribute(_qmoe(m), "k", 2.5), ("attribute k=2.5 is not an integer",)),
    (lambda m: setattr(_initializer(m, SCALES), "data_type", onnx.TensorProto.INT32),
     (f"input fc1_scales ('{SCALES}') is int32; QMoE takes bfloat16 or float or float16",)),
    (lambda m: setattr(_initializer(m, QWEIGHT), "data_type", onnx.TensorProto.INT8),
     ("input fc1_experts_weights", "is int8; QMoE takes float8e4m3fn or uint8")),
])
def test_malformed_onnx_fields_are_named_before_anything_runs(copy_fixture, edit, fragments, cli):
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, edit)
    assert_clean_error(cli("inspect", str(folder)), "model.onnx", *fragments)


@pytest.mark.parametrize("name", ["normalize_routing_weights", "use_sparse_mixer"])
def test_a_routing_flag_other_than_0_or_1_is_named_not_read_as_on(copy_fixture, name, cli):
    """Was: run as on (Python's truth of 2), where onnxruntime, which reads the flag as `== 1`, runs it off: an
    answer other than onnxruntime's, unsaid."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, lambda m: _attribute(_qmoe(m), name, 2))
    fragment = f"model.onnx: node '/model/layers.0/moe/QMoE' attribute {name}=2 is neither 0 nor 1"
    assert_clean_error(cli("inspect", str(folder)), fragment)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), fragment)


@pytest.mark.parametrize("value", [-7.0, float("nan")])
def test_a_swiglu_limit_negative_or_nan_is_named_not_run(copy_fixture, value, cli):
    """Was: accepted and run, clamping the gate to a bound below the up's lower one (or comparing with NaN): answers
    the contract's clamp to [-limit, limit] does not define."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, lambda m: _attribute(_qmoe(m), "swiglu_limit", value))
    fragment = (f"model.onnx: node '/model/layers.0/moe/QMoE' attribute swiglu_limit={value!r} is not a number "
                "from 0 up (inf: no clamp)")
    assert_clean_error(cli("inspect", str(folder)), fragment)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), fragment)


@pytest.mark.parametrize("name, value, fragment", [
    ("swiglu_limitt", 7.0, "attribute 'swiglu_limitt', which QMoE does not have (onnxruntime refuses the model): "
                           "did you mean 'swiglu_limit'?"),
    ("expert_parallel_groups", 4, "attribute 'expert_parallel_groups', which QMoE does not have (onnxruntime refuses "
                                  "the model)"),
])
def test_a_qmoe_attribute_onnxruntime_does_not_know_is_named(copy_fixture, cli, name, value, fragment):
    """Was: accepted and ignored, a misspelt swiglu_limit running the node unclamped, where onnxruntime refuses the
    model ("Unrecognized attribute: swiglu_limitt for operator QMoE")."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, lambda m: _attribute(_qmoe(m), name, value))
    said = f"model.onnx: node '/model/layers.0/moe/QMoE' has {fragment}"
    assert_clean_error(cli("inspect", str(folder)), said)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), said)
    assert cli("inspect", str(folder)).stderr.strip().endswith(fragment)


def test_the_expert_attributes_known_are_onnxruntimes():
    """The attributes the engine knows of each expert op are those onnxruntime 1.32's schemas give it."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    from engine.expert_node import _KNOWN_ATTRIBUTES
    from tests.qmoe_oracle import require_oracle

    require_oracle()

    schemas = {s.name: set(s.attributes) for s in ort_state.get_all_operator_schema()
               if s.domain == "com.microsoft" and s.name in _KNOWN_ATTRIBUTES}
    assert schemas == _KNOWN_ATTRIBUTES


@pytest.mark.parametrize("text, damaged, said", [
    (b"model.onnx.data", b"model.on\x9bx.data",
     r"initializer 'model.embed_tokens.weight' external data location 'model.on\x9bx.data' is not UTF-8 text"),
    (b"model.layers.0.moe.experts.gate_up_proj.bias", b"\x9bodel.layers.0.moe.experts.gate_up_proj.bias",
     r"node '/model/layers.0/moe/QMoE' input 4 '\x9bodel.layers.0.moe.experts.gate_up_proj.bias' is not UTF-8 text"),
    (b"present.1.value", b"present.1.valu\x9b",
     r"node '/model/layers.1/attn/GroupQueryAttention' output 2 'present.1.valu\x9b' is not UTF-8 text"),
])
def test_a_name_in_model_onnx_that_is_not_utf8_is_named(copy_fixture, cli, text, damaged, said):
    """A damaged byte in a name, which protobuf hands over as bytes: a data file's location failed as 'internal
    error: TypeError: unsupported operand type(s) for /: 'PosixPath' and 'bytes'', a node's input as
    "reads [b'\\x9bodel...'], which no node produces"."""
    folder = copy_fixture("gptoss")
    raw = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(raw.replace(text, damaged, 1))  # (the same length: the file still parses)
    assert_clean_error(cli("inspect", str(folder)), f"model.onnx: {said}")


def _inline(name: str, raw: bytes):
    def edit(model):
        tensor = _initializer(model, name)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = raw
    return edit


@pytest.mark.parametrize("name", [BIAS, "model.embed_tokens.weight"])
def test_an_inline_initializer_whose_values_do_not_fill_its_shape_is_named_at_open(copy_fixture, name, cli):
    """inspect called such a folder runnable; generate then failed with 'internal error: ValueError: cannot reshape
    array of size 25 into shape (8,256)' for an expert weight (onnxruntime named a dense one only at the load)."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, _inline(name, b"\0" * 100))
    for command in (["inspect"], ["generate", "--prompt", "hi", "--max-new-tokens", "1"]):
        assert_clean_error(cli(*command, str(folder)), f"{folder / 'model.onnx'}: initializer '{name}' holds values "
                           "that do not fill its shape [", "(cannot reshape array of size 25 into shape")
    size = OnnxFile.tensor_nbytes(_initializer(onnx.load(str(folder / "model.onnx"), load_external_data=False), name))
    _edit_onnx(folder, _inline(name, b"\0" * size))  # one that fills it opens
    assert cli("inspect", str(folder)).returncode == 0


def _halve(*dims_of: tuple[str, int]):
    """Each named initializer with dimension `axis` halved, and its external data's length with it."""
    def edit(model):
        for name, axis in dims_of:
            tensor = _initializer(model, name)
            tensor.dims[axis] //= 2
            _set_external(tensor, "length", str(OnnxFile.tensor_nbytes(tensor)))
    return edit


FC2 = "model.layers.0.moe.experts.down_proj."


# weights for hidden size 64, consistent among themselves; the graph's norm hands the node 128
HIDDEN_64 = ((QWEIGHT, 2), (SCALES, 2), (FC2 + "qweight", 1), (FC2 + "scales", 1), (FC2 + "bias", 1))
# 4 experts' weights; the graph's router gives 8 logits a token
EXPERTS_4 = tuple((name, 0) for name in (QWEIGHT, SCALES, BIAS, FC2 + "qweight", FC2 + "scales", FC2 + "bias"))


@pytest.mark.parametrize("dims_of, fragment", [
    (HIDDEN_64, "input 'fc1_experts_weights' has shape (8, 256, 32), expected (8, 256, 64) for int4 weights with E=8, "
                "hidden=128"),
    (EXPERTS_4, "router_probs has 8 experts, weights have 4"),
])
def test_expert_weights_that_contradict_the_shapes_the_graph_declares_are_refused(copy_fixture, dims_of, fragment, cli):
    """The node's activations were never checked against its weights: either model answered, reading its activations
    as rows of other sizes (a token's 128 values as two of 64; 8 router logits as two tokens' 4)."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, _halve(*dims_of))
    inspect = cli("inspect", str(folder))
    assert inspect.returncode == 1 and f"UNSUPPORTED: node '/model/layers.0/moe/QMoE': {fragment}" in inspect.stdout
    assert_clean_error(cli("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"),
                       f"node '/model/layers.0/moe/QMoE': {fragment}")


@pytest.mark.parametrize("dims_of, fragment", [
    (HIDDEN_64, "input '/model/layers.0/post_attention_layernorm/output_0' has 128 values a token; its weights take "
                "hidden size 64"),
    (EXPERTS_4, "router_probs '/model/layers.0/moe/router/Reshape/output_0' has shape (15, 8) for 15 tokens; its "
                "weights have 4 experts"),
])
def test_expert_weights_that_contradict_activations_the_graph_does_not_declare_are_refused_at_the_first_step(
        copy_fixture, dims_of, fragment, cli):
    """Without value_info, nothing said the shapes: the model answered, its kernels reading past the routing."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, _halve(*dims_of))
    _edit_onnx(folder, lambda model: model.graph.ClearField("value_info"))
    assert cli("inspect", str(folder)).returncode == 0
    assert_clean_error(cli("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"),
                       f"{folder / 'model.onnx'}: node '/model/layers.0/moe/QMoE' {fragment}")


def test_a_router_weights_input_that_is_a_constant_initializer_is_refused_at_open(copy_fixture, cli):
    """The engine hands an expert node the activations the dense part computed: an initializer there was
    'internal error: KeyError: 'weights'' at the first step, after inspect had called the model runnable."""
    folder = copy_fixture("gptoss")

    def add_router_weights(model):
        model.graph.initializer.append(onnx.helper.make_tensor("weights", onnx.TensorProto.FLOAT, [1, 8], [0.125] * 8))
        node = _qmoe(model)
        node.input.extend([""] * (14 - len(node.input)) + ["weights"])  # input 14: router_weights
    _edit_onnx(folder, add_router_weights)
    for command in (["inspect"], ["generate", "--prompt", "hi", "--max-new-tokens", "1"]):
        assert_clean_error(cli(*command, str(folder)), f"{folder / 'model.onnx'}: node '/model/layers.0/moe/QMoE' "
                           "input 'router_weights' ('weights') is a constant initializer; MoE Workbench runs QMoE nodes "
                           "whose input, router_probs, router_weights the graph computes")


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data", "tokenizer.json"])
def test_a_git_lfs_pointer_in_place_of_a_model_file_is_named_as_one(copy_fixture, name, cli):
    """A model repository cloned without git-lfs holds pointers of a few lines for its large files: they were called
    'not a valid ONNX model (DecodeError: …)', 'truncated: … the file has 132' and 'not a valid tokenizer (expected
    value at line 1 column 1)', none of which says what to do."""
    folder = copy_fixture("gptoss")
    (folder / name).write_text("version https://git-lfs.github.com/spec/v1\n"
                               "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
                               "size 1149792\n")
    assert_clean_error(cli("inspect", str(folder)), f"{folder / name}: a Git LFS pointer for 1,149,792 bytes, not the "
                       "file itself (run 'git lfs pull' in the model folder to download it)")


def test_nothing_outside_the_model_folder_is_read(copy_fixture, tmp_path, cli):
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = str(fixture_folder("gptoss") / "model.onnx")
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), "genai_config.json: model.decoder.filename",
                       "is not a file inside the model folder")
    linked = copy_fixture("lfm2moe")
    (linked / "model.onnx.data").unlink()
    (linked / "model.onnx.data").symlink_to(tmp_path / "elsewhere.data")
    (tmp_path / "elsewhere.data").write_bytes(b"\0" * 16)
    assert_clean_error(cli("inspect", str(linked)), "points outside the model folder ('model.onnx.data')")


def test_an_onnxruntime_failure_while_running_is_one_line_naming_the_dense_part(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["head_size"] -= 1  # the KV cache's shape then disagrees with the graph's
    (folder / "genai_config.json").write_text(json.dumps(config))

    def undeclare_attention_outputs(model):  # which the open holds head_size against: onnxruntime alone finds it
        outputs = {n.output[0] for n in model.graph.node if n.op_type == "GroupQueryAttention"}
        kept = [value for value in model.graph.value_info if value.name not in outputs]
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)

    _edit_onnx(folder, undeclare_attention_outputs)
    result = cli("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2")
    assert_clean_error(result, "model.onnx: onnxruntime failed to run the dense part from node", "GroupQueryAttention")
    assert "[E:onnxruntime" not in result.stdout + result.stderr  # its logger's own line is not shown


@pytest.mark.parametrize("head_size, fragment", [
    (48, "genai_config.json: 'model.decoder.head_size' is 48, but node '/model/layers.0/attn/GroupQueryAttention' "
         "attends with heads of 32 (its output has 128 values over its 4 heads)"),
    (None, "genai_config.json: missing 'model.decoder.head_size', which sizes the KV cache 'past_key_values.0.key' "
           "(its last dimension is 'kv_cache_dim' in the graph)"),
])
def test_a_head_size_that_does_not_size_the_kv_cache_is_named_at_open(copy_fixture, cli, head_size, fragment):
    """Was: inspect called the model runnable, and generate failed at its first step in onnxruntime's words ("Input
    'past_key' dimension 3 should match the packed KV head dimension"), naming neither genai_config.json nor the
    field."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"].pop("head_size")
    if head_size is not None:
        config["model"]["decoder"]["head_size"] = head_size
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), fragment)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), fragment)


@pytest.mark.parametrize("window", [10 ** 30, 2 ** 45])
def test_a_sliding_window_too_large_to_allocate_is_named_at_open(copy_fixture, cli, window):
    """Was: inspect said the model runs, and generate failed at its first step as the KV cache was allocated (10**30:
    'Maximum allowed dimension exceeded'; 2**45 slots: 8 PiB). Now both refuse it at open, by one check."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["sliding_window"]["window_size"] = window
    (folder / "genai_config.json").write_text(json.dumps(config))
    said = (f"genai_config.json: 'model.decoder.sliding_window' makes 2 KV caches ('past_key_values.0.key', …) of "
            f"{window:,} slots each (window_size {window:,} and cache_slack 0), which take more than this machine's "
            f"{human_bytes(psutil.virtual_memory().total)} of memory")
    assert_clean_error(cli("inspect", str(folder)), said)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), said)


@pytest.mark.parametrize("fixture, window, layer, attends", [
    ("lfm2moe", {"window_size": 16}, 1, "the whole context of 2,048 tokens (its local_window_size is -1)"),
    ("gptoss", {"window_size": 32, "layers": [0]}, 0, "the last 64 tokens (its local_window_size is 64)"),
])
def test_a_sliding_window_smaller_than_its_attention_is_named_at_open(copy_fixture, cli, fixture, window, layer,
                                                                      attends):
    """Was: inspect said the model runs; generate failed at the step that filled the window's cache, in onnxruntime's
    words ("has shape {1,2,16,32} but the computed output shape for this run is {1,2,17,32}"; "KV cache capacity (32)
    must be at least local_window_size (64)"), naming neither genai_config.json nor its sliding_window."""
    folder = copy_fixture(fixture)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["sliding_window"] = window
    (folder / "genai_config.json").write_text(json.dumps(config))
    said = (f"genai_config.json: 'model.decoder.sliding_window' makes layer {layer}'s KV cache "
            f"'past_key_values.{layer}.key' {window['window_size']} slots, but node "
            f"'/model/layers.{layer}/attn/GroupQueryAttention' attends over {attends}")
    assert_clean_error(cli("inspect", str(folder)), said)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), said)
    # a full-attention layer whose whole context the window's cache holds is read as before; a local window larger
    # than the cache stays refused whatever the context (GroupQueryAttention demands the capacity)
    config["model"]["context_length"] = 16
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert (cli("inspect", str(folder)).returncode == 0) == (fixture == "lfm2moe")


def test_a_sliding_window_layer_the_model_lacks_is_named(copy_fixture, cli):
    """Was: accepted, the window kept for no layer there is: a layer index typed wrong (5 for 1) ran its own layer
    with full attention, unsaid."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["sliding_window"]["layers"] = [0, 5]
    (folder / "genai_config.json").write_text(json.dumps(config))
    fragment = ("genai_config.json: 'model.decoder.sliding_window.layers' names layer 5; "
                "'model.decoder.num_hidden_layers' is 2 (layers 0 to 1)")
    assert_clean_error(cli("inspect", str(folder)), fragment)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), fragment)


def test_a_sliding_window_layer_the_graph_lacks_is_named_without_num_hidden_layers(copy_fixture, cli):
    """Was: accepted where genai_config.json gives no num_hidden_layers (the check above had nothing to hold the
    layers against); now held against the layers of the graph's past-state inputs."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["sliding_window"]["layers"] = [0, 5]
    del config["model"]["decoder"]["num_hidden_layers"]
    (folder / "genai_config.json").write_text(json.dumps(config))
    fragment = ("genai_config.json: 'model.decoder.sliding_window.layers' names layer 5; the graph's past-state "
                "inputs are of layers 0 to 1 (genai_config.json gives no 'model.decoder.num_hidden_layers')")
    assert_clean_error(cli("inspect", str(folder)), fragment)
    assert_clean_error(cli("generate", str(folder), "--device", "simulated", "--prompt", "hi"), fragment)
    config["model"]["decoder"]["sliding_window"]["layers"] = [0]  # a layer the graph has: read as before
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert cli("inspect", str(folder)).returncode == 0


def test_genai_config_sections_of_the_wrong_kind_are_named(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    original = json.loads((folder / "genai_config.json").read_text())
    for edit, fragment in ((lambda c: c["model"].update(decoder=None), "'model.decoder' is null, not a JSON object"),
                           (lambda c: c["model"]["decoder"].update(inputs=["input_ids"]),
                            "'model.decoder.inputs' is [\"input_ids\"], not a JSON object"),
                           (lambda c: c.update(search=[1]), "'search' is [1], not a JSON object"),
                           (lambda c: c["model"].update(eos_token_id=-1), "'model.eos_token_id' is -1, not token ids"),
                           (lambda c: c.update(search={"max_length": "x"}), "'search.max_length' is 'x', not an integer")):
        config = json.loads(json.dumps(original))
        edit(config)
        (folder / "genai_config.json").write_text(json.dumps(config))
        assert_clean_error(cli("inspect", str(folder)), "genai_config.json: " + fragment)


def test_transformers_named_chat_templates_use_the_default_one(copy_fixture, cli):
    from engine.tokenizer import ModelTokenizer

    folder = copy_fixture("qwen35moe")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                               {"name": "default", "template": "{% for m in messages %}<{{ m.content }}>{% endfor %}"}]
    config_path.write_text(json.dumps(config))
    assert ModelTokenizer(folder).render_chat([{"role": "user", "content": "hi"}]) == "<hi>"
    config["chat_template"] = config["chat_template"][:1]
    config_path.write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), "tokenizer_config.json: chat_template names templates "
                       "['tool_use'] but no 'default' one")


@pytest.mark.parametrize("field, value, fragment", [
    ("eos_token", 5, "'eos_token' is 5, not a token's text (a string or {\"content\": \"...\"})"),
    ("eos_token", ["<|endoftext|>"], "'eos_token' is [\"<|endoftext|>\"], not a token's text"),
    ("pad_token", {"id": 3}, "'pad_token' is {\"id\": 3}, not a token's text"),
    ("chat_template", ["{{ messages }}"], "'chat_template' holds \"{{ messages }}\", not a named template "
                                          '({"name": "...", "template": "..."})'),
    ("chat_template", [{"name": "default", "template": 5}],
     "'chat_template' holds {\"name\": \"default\", \"template\": 5}, not a named template"),
    ("chat_template", {"default": ["x"]}, "'chat_template.default' is [\"x\"], not a template"),
    ("additional_special_tokens", "<|im_end|>", "'additional_special_tokens' is \"<|im_end|>\", not a list of "
                                                "tokens' texts"),
    ("additional_special_tokens", {"content": "<|im_end|>"}, "'additional_special_tokens' is {\"content\": "
                                                             "\"<|im_end|>\"}, not a list of tokens' texts"),
])
def test_tokenizer_config_fields_of_the_wrong_type_are_named(copy_fixture, cli, field, value, fragment):
    """Was: a special token of another type read as none (the template rendered eos_token as ''), a named
    template of another form passed over ("names templates [] but no 'default' one"), neither naming the field, and
    additional_special_tokens not a list read as none, unsaid."""
    from engine.tokenizer import ModelTokenizer

    folder = copy_fixture("gptoss")
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}  # the form transformers also writes
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ModelTokenizer(folder).eos_token == "<|endoftext|>"
    config[field] = value
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), f"tokenizer_config.json: {fragment}")


def test_what_only_a_load_found_is_named_by_inspect_an_unknown_operator_and_unmatched_state_names(copy_fixture, cli):
    folder = copy_fixture("gptoss")

    def rename(model):
        node = next(n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization")
        node.op_type = "FooBar"

    _edit_onnx(folder, rename)
    assert_clean_error(cli("inspect", str(folder)), "model.onnx: node '",
                       "operator 'FooBar' of domain 'ai.onnx' is not one onnxruntime")
    state = copy_fixture("lfm2moe")
    config = json.loads((state / "genai_config.json").read_text())
    del config["model"]["decoder"]["inputs"]["past_conv_names"]  # a past state the graph reads, unnamed
    (state / "genai_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(state)), "genai_config.json: graph input '",
                       "is neither a genai_config input nor a past-state pattern")


def test_versions_onnxruntime_cannot_load_are_named_by_inspect(copy_fixture, cli):
    """An IR or operator set version newer than the installed onnxruntime's is refused when the folder is opened, in
    onnxruntime's own words without its source line and function."""
    def stamp(ir: int | None = None, opset: int | None = None):
        def edit(model):
            if ir is not None:
                model.ir_version = ir
            for entry in model.opset_import:
                if opset is not None and entry.domain in ("", "ai.onnx"):
                    entry.version = opset
        return edit

    newer_ir = copy_fixture("gptoss")
    _edit_onnx(newer_ir, stamp(ir=99))
    assert_clean_error(cli("inspect", str(newer_ir)), "model.onnx: onnxruntime ", "cannot load IR version 99 with "
                       "operator sets ai.onnx 22, com.microsoft 1: Unsupported model IR version: 99, max supported IR "
                       "version: ")
    newer_opset = copy_fixture("lfm2moe")
    _edit_onnx(newer_opset, stamp(opset=40))
    result = cli("inspect", str(newer_opset))
    assert_clean_error(result, "cannot load IR version 10 with operator sets ai.onnx 40", "Opset 40")
    assert "onnxruntime_src" not in result.stderr and "[ONNXRuntimeError]" not in result.stderr


def test_a_model_importing_no_operator_set_is_refused_by_inspect_not_called_runnable(copy_fixture, cli):
    """A model.onnx cut short right after its graph loses its opset_import, which comes last: onnxruntime refuses it
    at load ("Missing opset"), so inspect and the window's verdict must not say it runs."""
    folder = copy_fixture("lfm2moe")
    _edit_onnx(folder, lambda model: model.ClearField("opset_import"))
    assert_clean_error(cli("inspect", str(folder)), f"{folder / 'model.onnx'}: onnxruntime ",
                       "cannot load IR version 10 with operator sets none: Missing opset in the model")


@pytest.mark.parametrize("content, fragment", [
    ("[1, 2]", "the popularity file holds a JSON list, not an object of node names to counts per expert"),
    ('{"N": ["a", "b"]}', 'node \'N\' has "a" for expert 0, not a count (a number >= 0)'),
    ('{"N": 5}', "node 'N' has 5, not a list of counts per expert"),
    ('{"N": [1]}', "node 'N' has 1 counts, the node has 2 experts"),
    ('{"N": [1, 2, 3]}', "node 'N' has 3 counts, the node has 2 experts"),
    # the value and its expert named, not the whole row (128 counts in a Qwen3 layer's)
    ('{"N": [1, NaN]}', "node 'N' has NaN for expert 1, not a count (a number >= 0)"),
    ('{"N": [1, -2]}', "node 'N' has -2 for expert 1, not a count (a number >= 0)"),
    ('{"N": [-Infinity, 2]}', "node 'N' has -Infinity for expert 0, not a count (a number >= 0)"),
    ('{"N": [3, null]}', "node 'N' has null for expert 1, not a count (a number >= 0)"),
    ('{"N": [true, 1]}', "node 'N' has true for expert 0, not a count (a number >= 0)"),
    ('{"M": [1, 2]}', "the popularity file names 'M', which is no expert node of this model (they are N)"),
    ('{"N1": [1, 2]}', "the popularity file names 'N1', which is no expert node of this model (did you mean 'N'?)"),
])
def test_a_malformed_popularity_file_is_named_with_the_node_and_what_is_wrong(tmp_path, content, fragment, cli):
    from engine.errors import WorkbenchError
    from engine.offload.engine import load_popularity

    path = tmp_path / "popularity.json"
    path.write_text(content)
    with pytest.raises(WorkbenchError) as error:
        load_popularity(str(path), ["N"], [2])
    assert str(error.value) == f"{path}: {fragment}"
    if content.startswith("["):  # was an internal error
        result = cli("inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                         f"popularity_file={path}")
        assert_clean_error(result, f"{path}: {fragment}")


def test_popularity_counts_written_as_floats_or_shares_are_read(tmp_path):
    """A count exported as a float (120.0, as NumPy's tolist() of a float array gives it) reads, as do shares (0.25):
    placement only ranks experts by them."""
    from engine.offload.engine import load_popularity

    path = tmp_path / "popularity.json"
    path.write_text('{"N": [120.0, 0, 1e3, 0.25]}')
    assert load_popularity(str(path), ["N"], [4])[0].tolist() == [120.0, 0.0, 1000.0, 0.25]


def test_a_popularity_file_that_is_gone_or_a_folder_is_said_once_by_name(tmp_path):
    """A popularity file moved since the settings kept it was said as "/m/p.json: cannot read the popularity file
    ([Errno 2] No such file or directory: '/m/p.json')", its path twice and Python's errno in the user's words."""
    from engine.errors import WorkbenchError
    from engine.offload.engine import load_popularity

    for path, said in ((tmp_path / "moved.json", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(WorkbenchError) as raised:
            load_popularity(str(path), ["N"], [4])
        assert str(raised.value) == f"{path}: cannot read the popularity file ({said})"


def test_a_popularity_file_that_is_not_utf8_text_is_one_line_naming_it(tmp_path, cli):
    """A binary or UTF-16 file given as popularity_file was an internal error (UnicodeDecodeError) at load."""
    path = tmp_path / "popularity.json"
    path.write_bytes(b"\xff\xfe{\x00}\x00")
    result = cli("inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                     f"popularity_file={path}")
    assert_clean_error(result, f"{path}: cannot read the popularity file (not UTF-8 text: ")


def test_a_popularity_file_that_is_not_json_or_empty_says_so(tmp_path, cli):
    """Both read as 'cannot read the popularity file (Expecting value: line 1 column 1 (char 0))', which sent the user
    to the file's permissions rather than to its text."""
    path = tmp_path / "popularity.json"
    not_json = "the popularity file is not valid JSON (Expecting value: line 1 column 1 (char 0))"
    for text, said in (("not json", not_json), ("", "the popularity file is empty"),
                       ("\n", "the popularity file is empty")):
        path.write_text(text)
        result = cli("inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                     f"popularity_file={path}")
        assert_clean_error(result, f"{path}: {said}")


@pytest.mark.parametrize("count, fragment", [
    # too large for a float: was an internal error (OverflowError)
    ("9" * 400, f"node 'N' has {'9' * 40}… (400 characters) for expert 0, too large a count"),
    ("9" * 5000, "cannot read the popularity file (Exceeds the limit"),  # past Python's digits for an int: ValueError
    # a float past the largest reads as Infinity, as JSON's own Infinity: too large, not "not a number >= 0"
    ("1e400", "node 'N' has Infinity for expert 0, too large a count"),
    ("Infinity", "node 'N' has Infinity for expert 0, too large a count"),
    # negative, whatever its size: not a count, not too large a one
    ("-" + "9" * 400, f"node 'N' has -{'9' * 39}… (401 characters) for expert 0, not a count (a number >= 0)"),
    ("-1e400", "node 'N' has -Infinity for expert 0, not a count (a number >= 0)"),
])
def test_a_popularity_count_too_large_to_read_is_one_line_naming_the_file(tmp_path, count, fragment):
    from engine.errors import WorkbenchError
    from engine.offload.engine import load_popularity

    path = tmp_path / "popularity.json"
    path.write_text(f'{{"N": [{count}, 1]}}')
    with pytest.raises(WorkbenchError) as error:
        load_popularity(str(path), ["N"], [2])
    assert str(error.value).startswith(f"{path}: {fragment}") and "\n" not in str(error.value)


def test_a_popularity_file_made_for_another_model_says_so_rather_than_suggest_a_typo(tmp_path):
    """A 4-layer model's file given to a 2-layer model of the same family was refused with "did you mean
    '/model/layers.0/moe/QMoE'?", as if '/model/layers.2/moe/QMoE' were a typo."""
    from engine.errors import WorkbenchError
    from engine.offload.engine import load_popularity

    names = [f"/model/layers.{i}/moe/QMoE" for i in range(2)]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({f"/model/layers.{i}/moe/QMoE": [1, 2] for i in range(4)}))
    with pytest.raises(WorkbenchError) as error:
        load_popularity(str(path), names, [2, 2])
    assert str(error.value) == (f"{path}: the popularity file names 2 nodes this model does not have "
                                "('/model/layers.2/moe/QMoE', '/model/layers.3/moe/QMoE'): made for another model? "
                                "(this model's 2 expert nodes: '/model/layers.0/moe/QMoE' … '/model/layers.1/moe/QMoE')")


def test_onnxruntime_errors_lose_their_status_code_and_source_line_but_keep_their_details():
    from engine.errors import error_reason

    load = RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model from /m/model.onnx failed:/onnxruntime_src/"
                        "onnxruntime/core/graph/model.cc:256 onnxruntime::Model::Model(onnx::ModelProto&&, const "
                        "onnxruntime::PathString&) Unsupported model IR version: 99, max supported IR version: 14")
    assert error_reason(load) == "Unsupported model IR version: 99, max supported IR version: 14"
    shapes = RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x for the "
                          "following indices\n index: 0 Got: 3 Expected: 1\n")
    assert error_reason(shapes) == "Got invalid dimensions for input: x for the following indices index: 0 Got: 3 " \
                                   "Expected: 1"
    gather = RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
                          "Gather node. Name:'/model/embed_tokens/Gather' Status Message: /onnxruntime_src/onnxruntime/"
                          "core/providers/cpu/tensor/gather.cc:154 onnxruntime::common::Status onnxruntime::"
                          "GatherCommon(...) const indices element out of data bounds, idx=99")
    assert error_reason(gather) == ("Non-zero status code returned while running Gather node. Name:'/model/embed_tokens"
                                    "/Gather' Status Message: indices element out of data bounds, idx=99")
    assert error_reason(ValueError("first\nsecond")) == "first"


def test_node_overrides_naming_no_expert_node_are_refused_with_the_nearest_name(cli):
    result = cli("inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                     "node_overrides=/model/layers.0/moe/QMO:max_resident_slots=3")
    assert_clean_error(result, "node_overrides names '/model/layers.0/moe/QMO', which is no expert node of this model "
                               "(did you mean '/model/layers.0/moe/QMoE'?)")


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json",
                                  "tokenizer_config.json", "chat_template.jinja"])
def test_a_symbolic_link_loop_in_the_model_folder_is_named_not_an_internal_error(copy_fixture, name, cli):
    folder = copy_fixture("gptoss")
    (folder / name).unlink()
    (folder / name).symlink_to(name)
    assert_clean_error(cli("inspect", str(folder)), f"{folder / name}: a loop of symbolic links")


def test_a_model_folder_that_is_a_symbolic_link_loop_is_named(tmp_path, cli):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert_clean_error(cli("inspect", str(tmp_path / "a")), f"{tmp_path / 'a'}: a loop of symbolic links")


UNREADABLE = ["", "model.onnx", "model.onnx.data", "tokenizer.json"]
# inspect on each folder given, in one process: its exit status and what it wrote, by folder, as JSON
INSPECT_EACH = """import contextlib, io, json, sys
from app.cli import main
said = {}
for folder in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["inspect", folder])
    said[folder] = [status, out.getvalue(), err.getvalue()]
print(json.dumps(said))
"""


def run_python_bound_by_permissions(*args: str) -> subprocess.CompletedProcess:
    """`python ARGS` where file permissions apply: as root, without the capabilities that override them."""
    command = [sys.executable, *args]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root ignores file permissions and setpriv is not here to drop that")
        caps = "-dac_override,-dac_read_search"
        command = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--", *command]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def unreadable_inspected(tmp_path_factory):
    """For each name of UNREADABLE: a copy of gptoss where it (or, for "", the folder) has no read permission, and
    what inspect said of it. One process inspects the four (a process each cost seconds of imports)."""
    folders = {}
    for name in UNREADABLE:
        folder = tmp_path_factory.mktemp("unreadable") / "gptoss"
        shutil.copytree(fixture_folder("gptoss"), folder)
        for file in folder.iterdir():
            file.chmod(0o644)
        (folder / name).chmod(0)
        folders[name] = folder
    try:
        result = run_python_bound_by_permissions("-c", INSPECT_EACH, *map(str, folders.values()))
    finally:
        for name, folder in folders.items():
            (folder / name).chmod(0o755)
    assert result.returncode == 0 and not result.stderr, result.stderr
    said = json.loads(result.stdout)
    return {name: (folder, subprocess.CompletedProcess(["inspect", str(folder)], *said[str(folder)]))
            for name, folder in folders.items()}


@pytest.mark.parametrize("name", UNREADABLE)
def test_a_file_or_folder_without_read_permission_is_named_as_not_readable(unreadable_inspected, name):
    folder, result = unreadable_inspected[name]
    assert_clean_error(result, f"{folder / name}: not readable (Permission denied)")


def test_external_data_cut_short_after_the_folder_was_opened_is_named_at_the_load(copy_fixture):
    """The window loads the folder it inspected: a data file rewritten shorter in between failed the load with
    'ValueError: buffer is smaller than requested size' (or 'cannot mmap an empty file'), one removed with
    'FileNotFoundError', naming no file."""
    from engine.errors import ModelFileError
    from engine.generation import LoadedModel
    from engine.model_folder import ModelFolder

    folder = copy_fixture("gptoss")
    opened = ModelFolder.open(folder)
    data = folder / "model.onnx.data"
    os.truncate(data, data.stat().st_size // 2)
    said = rf"^{data}: truncated since the model folder was opened: it has 574896 bytes of the 1149792 its initializers"
    with pytest.raises(ModelFileError, match=said):
        LoadedModel(opened)
    removed = copy_fixture("qwen35moe")
    opened = ModelFolder.open(removed)
    (removed / "model.onnx.data").unlink()
    with pytest.raises(ModelFileError, match=rf"^{removed / 'model.onnx.data'}: not readable \(No such file"):
        LoadedModel(opened)
    emptied = copy_fixture("lfm2moe")
    opened = ModelFolder.open(emptied)
    os.truncate(emptied / "model.onnx.data", 0)  # a mapping of an empty file is refused outright
    said = rf"^{emptied / 'model.onnx.data'}: truncated since the model folder was opened: it has 0 bytes of the"
    with pytest.raises(ModelFileError, match=said):
        LoadedModel(opened)


def test_a_data_file_written_to_or_replaced_after_the_folder_was_opened_is_named_at_the_load(copy_fixture):
    """A data file's modification time was taken when it was mapped, at the load, not when the folder was opened (its
    size checked): one written to in place at its size in between had the load read its new bytes under the graph
    opened before, and every later check hold them as the loaded model's. Its time is taken at the opening, the load
    refusing a file whose time moved since, written to in place or replaced by another, naming it."""
    from engine.errors import ModelFileError
    from engine.generation import LoadedModel
    from engine.model_folder import ModelFolder

    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    said = (rf"^{re.escape(str(data))}: changed since the model folder was opened \(written to or replaced\): open the "
            "model again to load what it holds now$")
    opened = ModelFolder.open(folder)
    _write_in_place(data)
    with pytest.raises(ModelFileError, match=said):
        LoadedModel(opened)
    opened = ModelFolder.open(folder)
    fresh = folder.parent / "fresh.data"
    fresh.write_bytes(data.read_bytes())
    os.replace(fresh, data)
    with pytest.raises(ModelFileError, match=said):
        LoadedModel(opened)
    LoadedModel(ModelFolder.open(folder)).folder.onnx.check_mapped_files()  # opened again: loaded, and held as loaded


def test_a_data_file_rewritten_in_place_at_its_size_after_the_load_is_refused_by_name(copy_fixture):
    """The experts are read from a shared mapping of the data file: one rewritten in place at the same size after the
    load (other weights written over it) changed the loaded model's weights unsaid, since only the size was checked.
    The check each answer (and run, re-plan) starts with refuses it, naming the file. One replaced by another file
    (a new inode) is not: the mapping keeps the loaded file's bytes."""
    from engine.errors import ModelFileError
    from engine.generation import LoadedModel

    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    whole = data.read_bytes()
    replaced = LoadedModel.open(folder)
    fresh = folder.parent / "fresh.data"
    fresh.write_bytes(whole[::-1])
    os.replace(fresh, data)
    replaced.folder.onnx.check_mapped_files()
    data.write_bytes(whole)  # the replacement, rewritten in place
    model = LoadedModel.open(folder)
    model.folder.onnx.check_mapped_files()
    time.sleep(0.01)  # past the file system's timestamp granularity (a few ms at most)
    with open(data, "r+b") as rewritten:
        rewritten.write(whole[::-1])
    with pytest.raises(ModelFileError, match=rf"^{re.escape(str(data))}: changed since the model was loaded \(written "
                                             r"to in place\); load the model again$"):
        model.folder.onnx.check_mapped_files()


def test_a_data_file_truncated_during_an_answer_stops_it_before_the_next_step_reads_the_file(copy_fixture):
    """The check an answer starts with came once: a data file cut short between two of its steps (the folder
    rewritten during an answer) had the next step's kernels read past its end, which kills the process (SIGBUS). Each
    step, the prefill included, checks the mapped files' sizes first: the answer stops with the refusal naming the
    file, the step not run. (Cut short by a few bytes, its last page kept: a step run regardless reads no page past
    the end, and this process lives to fail.)"""
    from engine.errors import ModelFileError
    from engine.generation import GenerationParams, LoadedModel, generate

    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    whole = data.read_bytes()
    said = (rf"^{re.escape(str(data))}: truncated since the model was loaded: it has {len(whole) - 4} bytes of the "
            rf"{len(whole)} its initializers take; load the model again$")
    params = GenerationParams(max_new_tokens=8)

    def cut_short(*_args) -> None:
        os.truncate(data, len(whole) - 4)

    model = LoadedModel.open(folder)
    prompt = model.tokenizer.encode("The expert offload engine")
    state, fed = model.new_state(), []
    with pytest.raises(ModelFileError, match=said):  # cut short once the first token is out: before the next step
        generate(model, state, fed, prompt, params, on_text=cut_short)
    assert model.decoder.profile["steps"] == 1 and state.past_length == len(prompt) and fed == prompt  # the prefill
    data.write_bytes(whole)
    model = LoadedModel.open(folder)
    state, fed = model.new_state(), []
    with pytest.raises(ModelFileError, match=said):  # cut short once the prompt is accepted: before the prefill
        generate(model, state, fed, prompt, params, before_feed=cut_short)
    assert model.decoder.profile["steps"] == 0 and state.past_length == 0 and fed == []


def _write_in_place(data) -> None:
    """Zeros over the first page of `data`, at its size, its modification time past the timestamps' granularity."""
    with open(data, "r+b") as file:
        file.write(bytes(4096))
    stamp = data.stat()
    os.utime(data, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))


def _written_in_place(data) -> str:
    return f"{data}: changed since the model was loaded (written to in place); load the model again"


def test_a_data_file_written_in_place_during_an_answer_stops_it_before_the_next_step_reads_the_new_bytes(
        copy_fixture):
    """A data file written to in place at its size between two steps of an answer (the model exported again into its
    folder) had the rest of the answer decoded from its new bytes: each step checked the mapped files' sizes only, their
    modification times waiting for the next answer. Each step checks both, from the one fstat a file: the answer stops
    with the refusal naming the file, the step not run."""
    from engine.errors import ModelFileError
    from engine.generation import GenerationParams, LoadedModel, generate

    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    model = LoadedModel.open(folder)
    prompt = model.tokenizer.encode("The expert offload engine")
    state, fed = model.new_state(), []
    with pytest.raises(ModelFileError, match=f"^{re.escape(_written_in_place(data))}$"):
        generate(model, state, fed, prompt, GenerationParams(max_new_tokens=8),
                 on_text=lambda *_args: _write_in_place(data))
    assert model.decoder.profile["steps"] == 1 and state.past_length == len(prompt) and fed == prompt  # the prefill


def test_a_data_file_moved_out_of_the_folder_then_written_to_is_refused_by_name(copy_fixture, tmp_path):
    """The mapping is of the file, not of its path: moved away and written to, its new bytes are what the loaded model
    reads. Checked through its path, it was taken for removed (the mapping whole) and let be."""
    from engine.errors import ModelFileError
    from engine.generation import LoadedModel

    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    model = LoadedModel.open(folder)
    moved = tmp_path / "moved.data"
    os.rename(data, moved)
    model.folder.onnx.check_mapped_files()
    _write_in_place(moved)
    with pytest.raises(ModelFileError, match=f"^{re.escape(_written_in_place(data))}$"):
        model.folder.onnx.check_mapped_files()


def test_generate_says_a_data_file_written_in_place_during_its_answer_in_one_line(copy_fixture, cli, monkeypatch):
    """The refusal as the command line says it: the answer streamed so far, then the one line naming the file."""
    from app.cli import _StreamedAnswer

    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    answer = _StreamedAnswer.answer

    def answer_then_write(self, token, delta) -> None:
        answer(self, token, delta)
        _write_in_place(data)

    monkeypatch.setattr(_StreamedAnswer, "answer", answer_then_write)
    result = cli("generate", str(folder), "--raw", "--prompt", "The expert offload engine", "--greedy",
                 "--max-new-tokens", "8")
    assert_clean_error(result)
    said = f"moe-workbench: error: {_written_in_place(data)}"
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == said


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json"])
def test_a_folder_where_a_model_file_should_be_is_named_as_a_folder_not_missing(copy_fixture, name, cli):
    folder = copy_fixture("gptoss")
    (folder / name).unlink()
    (folder / name).mkdir()
    assert_clean_error(cli("inspect", str(folder)), f"{folder / name}: a folder, not a file")


def test_a_model_filename_naming_the_folder_itself_is_not_called_missing(copy_fixture, cli):
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "."
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert_clean_error(cli("inspect", str(folder)), f"{folder}: a folder, not a file")


@pytest.mark.parametrize("name", ["genai_config.json", "tokenizer_config.json"])
def test_json_nested_past_what_python_reads_is_named_not_an_internal_error(copy_fixture, name, cli):
    folder = copy_fixture("gptoss")
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    assert_clean_error(cli("inspect", str(folder)), f"{folder / name}: not valid JSON (nested too deeply")


@pytest.mark.parametrize("name", ["same", ""])
def test_expert_nodes_sharing_a_name_are_refused_at_open_naming_it(copy_fixture, name, cli):
    """The engine keys an expert node's slots, placement and settings by its name: two of one name planned 5 slots for
    16 experts and generate failed with 'internal error: KeyError'."""
    folder = copy_fixture("gptoss")

    def rename(model):
        for node in model.graph.node:
            if node.op_type == "QMoE":
                node.name = name
    _edit_onnx(folder, rename)
    for command in (["inspect"], ["generate", "--prompt", "hi", "--max-new-tokens", "2"]):
        assert_clean_error(cli(*command, str(folder)),
                           f"{folder / 'model.onnx'}: 2 expert nodes are named '{name}'")


def _dims(name: str, dims: list[int]):
    def edit(model):
        tensor = _initializer(model, name)
        del tensor.dims[:]
        tensor.dims.extend(dims)
    return edit


@pytest.mark.parametrize("dims, fragment", [
    ([-8, 256, 64], f"initializer '{QWEIGHT}' has shape [-8, 256, 64], a negative dimension"),
    ([2**32, 2**32, 4], f"initializer '{QWEIGHT}' has length 131072 but its shape needs 73786976294838206464 bytes"),
])
def test_an_initializer_shape_that_is_negative_or_overflows_is_named_as_it_is(copy_fixture, dims, fragment, cli):
    """Its size was counted in int64: a negative dimension 'needed -131072 bytes', [2**32, 2**32, 4] wrapped to 0."""
    folder = copy_fixture("gptoss")
    _edit_onnx(folder, _dims(QWEIGHT, dims))
    assert_clean_error(cli("inspect", str(folder)), fragment)


def test_a_prompt_token_past_the_models_embedding_names_tokenizer_json_the_token_and_the_vocabulary(copy_fixture, cli):
    """A tokenizer.json with more tokens than the model's embedding has rows (tokens added to it, another model's
    tokenizer): a prompt holding one failed inside onnxruntime, "Gather node … indices element out of data bounds,
    idx=512 must be within the inclusive range [-512,511]", naming neither the token nor tokenizer.json. It is refused
    before the model runs, and the conversation answers the next prompt."""
    from tokenizers import AddedToken, Tokenizer

    from engine.errors import PromptError
    from engine.generation import Conversation, GenerationParams, LoadedModel

    folder = copy_fixture("gptoss")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken("zebrafish", normalized=False)])
    tokenizer.save(str(folder / "tokenizer.json"))
    assert tokenizer.token_to_id("zebrafish") == 512  # the fixture's embedding has rows 0 to 511
    refused = (f"{folder / 'tokenizer.json'}: the prompt holds token 512, past the model's vocabulary of 512 tokens "
               "in model.onnx: the tokenizer has tokens the model was not made with")
    assert_clean_error(cli("generate", str(folder), "--raw", "--prompt", "the zebrafish swims"), refused)
    conversation = Conversation(LoadedModel.open(folder))
    with pytest.raises(PromptError) as caught:
        conversation.send("the zebrafish swims", GenerationParams(max_new_tokens=2))
    assert str(caught.value) == refused
    assert conversation.send("the fish swims", GenerationParams(max_new_tokens=2)).tokens


def test_a_folder_named_chat_template_jinja_is_named_as_a_folder(copy_fixture, cli):
    """Was: passed over, the model then said to have no chat template at its first chat."""
    folder = copy_fixture("gptoss")
    template = folder / "chat_template.jinja"
    template.unlink()
    template.mkdir()
    fragment = f"{template}: a folder, not a file"
    assert_clean_error(cli("inspect", str(folder)), fragment)
    assert_clean_error(cli("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"), fragment)


def test_inspect_says_a_model_whose_chat_template_cannot_render_cannot_run(copy_fixture, cli):
    """Was: inspect said 'runs: all 2 expert nodes are supported', and every chat then failed at its first prompt."""
    folder = copy_fixture("gptoss")
    template = folder / "chat_template.jinja"
    for source, said in (("{{ 1/0 }}", "chat template failed to render (division by zero)"),
                         ("{{ raise_exception('no system message') }}",
                          "the chat template refused the conversation: no system message"),
                         ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                          "chat template failed to render (still rendering after 2 s (a loop without end?))")):
        template.write_text(source)
        result = cli("inspect", str(folder))
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stdout.splitlines()[-1] == f"cannot run: {template}: {said}"
        report = json.loads(cli("inspect", str(folder), "--json").stdout)
        assert not report["supported"] and report["verdict"] == f"cannot run: {template}: {said}"
    template.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    result = cli("inspect", str(folder))
    assert result.returncode == 0
    assert result.stdout.splitlines()[-1] == "runs: all 2 expert nodes are supported by our CPU kernels"


def test_end_of_text_tokens_no_answer_can_end_on_are_warned_of(copy_fixture, cli):
    """Was: an eos_token_id past the vocabulary, or an eos_token the tokenizer has no token for, was taken without a
    word, and answers ran to their length. onnxruntime-genai loads such a model; so does the engine, saying why."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [0, 70000]
    (folder / "genai_config.json").write_text(json.dumps(config))
    tokens = json.loads((folder / "tokenizer_config.json").read_text())
    tokens["eos_token"] = "<|no such token|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokens))
    said = [f"warning: {folder / 'genai_config.json'}: model.eos_token_id 70000 is past the model's vocabulary of 512 "
            "tokens: no answer ends on it",
            f"warning: {folder / 'tokenizer_config.json'}: eos_token \"<|no such token|>\" is no token of "
            "tokenizer.json: no answer ends on it"]
    inspect = cli("inspect", str(folder))
    assert inspect.returncode == 0 and inspect.stdout.splitlines()[-2:] == said
    assert json.loads(cli("inspect", str(folder), "--json").stdout)["warnings"] == [line[9:] for line in said]
    generate = cli("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1")
    assert generate.returncode == 0 and [line for line in generate.stderr.splitlines() if line in said] == said
