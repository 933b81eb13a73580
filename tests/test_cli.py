"""The command line on real model folders."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import WorkbenchError
from engine.units import duration_text, human_bytes
from tests.conftest import fixture_folder, timed_sweep_warm_up
from tests.test_bad_input import REPO, run_cli


def test_inspect_lists_every_expert_node(cli):
    result = cli("inspect", str(fixture_folder("qwen35moe")), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [n["layer"] for n in report["expert_nodes"]] == [0, 1, 2, 3]
    node = report["expert_nodes"][0]
    assert node["experts"] == 8 and node["top_k"] == 2 and node["supported"]
    assert "int4" in node["layout"] and "32" in node["layout"]
    # gate_up [8,256,64] u8 + scales [8,256,4] f32 + bias [8,256] f32 + down [8,128,64] + [8,128,4] + [8,128]
    assert node["bytes"] == 8 * (256 * 64 + 256 * 4 * 4 + 256 * 4 + 128 * 64 + 128 * 4 * 4 + 128 * 4)
    assert node["bytes_per_expert"] * 8 == node["bytes"]
    assert report["dense_bytes"] > 0 and report["supported"]


def test_inspect_names_the_models_own_layers_where_the_first_ones_are_dense(cli):
    # the LFM2-MoE fixture's layer 0 is dense: its expert nodes are in layers 1-3 (their names say so)
    result = cli("inspect", str(fixture_folder("lfm2moe")), "--json")
    assert result.returncode == 0, result.stderr
    nodes = json.loads(result.stdout)["expert_nodes"]
    assert [(n["layer"], n["model_layer"]) for n in nodes] == [(0, 1), (1, 2), (2, 3)]
    assert all(f"/layers.{n['model_layer']}/" in n["node"] for n in nodes)
    text = cli("inspect", str(fixture_folder("lfm2moe"))).stdout.splitlines()
    assert [line.split()[0] for line in text[2:5]] == ["1", "2", "3"]


def test_inspect_text_has_verdict(cli):
    result = cli("inspect", str(fixture_folder("gptoss")))
    assert result.returncode == 0
    assert "runs: all 2 expert nodes are supported" in result.stdout


def test_inspect_on_a_device_says_the_budget_that_holds_every_expert(cli):
    """The table lists experts as stored (gptoss: 31.5 KiB each, 504.0 KiB in all), but budgets count device slots in
    the GPU kernels' layout (34.5 KiB): a device_expert_bytes of the 504 KiB the table adds up to held 14 of the 16
    experts, and nothing inspect printed named the budget that holds them all (a sweep's 100% point)."""
    gptoss = str(fixture_folder("gptoss"))
    result = cli("inspect", gptoss, "--device", "simulated")
    assert result.returncode == 0 and ("every expert resident on the device: an expert budget of 565248 bytes "
                                       "(552.0 KiB), 34.5 KiB a slot: the GPU kernels' layout of 31.5 KiB stored"
                                       in result.stdout.splitlines()), result.stdout
    for budget, held in ((504 << 10, 14), (565248, 16)):
        result = cli("inspect", gptoss, "--json", "--device", "simulated", "--offload", f"device_expert_bytes={budget}")
        offload = json.loads(result.stdout)["offload"]
        assert offload["all_resident_bytes"] == 565248 and sum(offload["slots"].values()) == held
        assert offload["slot_bytes"] == {"/model/layers.0/moe/QMoE": 35328, "/model/layers.1/moe/QMoE": 35328}
    # no device, or no expert budget (mode=disabled): no such line
    for more in ((), ("--device", "simulated", "--offload", "mode=disabled")):
        result = cli("inspect", gptoss, *more)
        assert result.returncode == 0 and "expert budget of" not in result.stdout


def test_inspect_with_a_device_says_what_the_decode_path_does_about_the_host_tier(cli):
    result = cli("inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated",
                     "--offload", "device_expert_bytes=200000", "--decode-path", "tier")
    assert result.returncode == 0, result.stderr
    statements = json.loads(result.stdout)["offload"]["statements"]
    assert statements[-1].startswith("Instead, decode reads cold experts on the GPU from a host tier of ")
    assert statements[-1].endswith(" KiB of page-locked host memory, as asked (decode path 'tier').")
    result = cli("inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated", "--decode-path", "gpu")
    assert result.returncode == 2 and "invalid choice: 'gpu'" in result.stderr
    # a limit that holds the slots and the staging ring but not the tier's mappings, each slot array's rows rounded up
    # to the 2 MiB granule: the load makes no tier, and inspect says so (it promised the tier)
    result = cli("inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated", "--decode-path", "tier",
                 "--offload", "device_expert_bytes=200000", "--offload", f"gpu_device_mem_limit={8 << 20}")
    assert result.returncode == 0, result.stderr
    said = json.loads(result.stdout)["offload"]["statements"][-1]
    assert said.startswith("Cold experts are computed on the CPU: no host tier is made, since its device mappings need "
                           "32.0 MiB (each slot array's device rows rounded up to the 2.0 MiB mapping granule; ")
    assert said.endswith(f"free for them under gpu_device_mem_limit={8 << 20}."), said


def test_inspect_says_the_device_memory_the_host_tier_takes_beside_a_zero_budget(cli):
    """At budget 0 the tier still maps each slot array's device rows, a 2 MiB granule each even without slots: the plan
    says so (it said 0 B of a 0 B budget and nothing of the 32 MiB), as the load's plan does."""
    from engine.generation import LoadedModel
    from engine.model_folder import ModelFolder
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import slots_device_bytes

    infos = ModelFolder.open(fixture_folder("gptoss")).experts
    mapped = slots_device_bytes(infos, {}, host_tier=True)
    assert mapped == 32 << 20
    said = (f"With the host tier, the expert slots take {human_bytes(mapped)} of device memory: each slot array's "
            "device rows are mapped rounded up to the 2.0 MiB granule, one granule even without slots.")
    for path in ("tier", "both"):
        result = cli("inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated", "--decode-path", path,
                     "--offload", "device_expert_bytes=0")
        assert result.returncode == 0, result.stderr
        statements = json.loads(result.stdout)["offload"]["statements"]
        assert statements[1] == said, statements
        model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=0),
                                 decode_path=path, device=SimulatedDevice(8 << 30))
        assert model.offload.host_tier and model.offload.plan.statements[1] == said
    # no tier (decode path cpu): no such sentence
    result = cli("inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated", "--decode-path", "cpu",
                 "--offload", "device_expert_bytes=0")
    assert not any(s.startswith("With the host tier") for s in json.loads(result.stdout)["offload"]["statements"])


def test_with_the_tier_in_force_the_plan_does_not_say_slotless_layers_decode_on_the_cpu(cli):
    """Under decode path 'tier' at budget 0 the GPU reads every cold expert from the host tier, those of the layers
    without expert slots too (HybridExpertNode runs such a step as a resident one); the plan said below the tier's
    sentence that "Decode misses of 2 layers without expert slots run on the CPU", unconditionally. Nor does it hint
    that device_working_bytes would copy some of them over PCIe: under 'tier' no decode step copies a miss."""
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice

    result = cli("inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated", "--decode-path", "tier",
                 "--offload", "device_expert_bytes=0")
    said = json.loads(result.stdout)["offload"]["statements"]
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=0), decode_path="tier",
                             device=SimulatedDevice(8 << 30))
    assert model.offload.decode_path_in_force == "tier" and model.offload.reads_tier
    assert said == model.offload.plan.statements
    assert said[-1].startswith("Instead, decode reads cold experts on the GPU from a host tier of "), said
    assert not any("without expert slots" in sentence or "device_working_bytes" in sentence for sentence in said), said


def test_whole_layers_under_the_host_tier_are_not_said_to_run_on_the_cpu(cli):
    """The layer split 'whole' said "the others run theirs on the CPU", where under decode path 'tier' the GPU reads
    those layers' experts from the host tier (and prefill streams them in waves): it says what the budget does, the
    layers without a slot, and the sentences after it where their experts run."""
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice

    result = cli("inspect", str(fixture_folder("qwen35moe")), "--json", "--device", "simulated", "--decode-path", "tier",
                 "--layer-split", "whole", "--offload", "device_expert_bytes=600000")
    said = json.loads(result.stdout)["offload"]["statements"]
    whole = ("The budget holds whole layers: 2 of 4 expert layers keep all their experts on the simulated GPU, 8.0 GiB; "
             "the other 2 have no expert slot there.")
    assert whole in said, said
    model = LoadedModel.open(fixture_folder("qwen35moe"), offload=OffloadConfig(device_expert_bytes=600000),
                             decode_path="tier", layer_split="whole", device=SimulatedDevice(8 << 30))
    assert model.offload.reads_tier and whole in model.offload.plan.statements


def test_inspects_plan_says_what_the_load_on_the_same_device_says(cli):
    """inspect's offload statements are the load's plan's, in its order (the plan, the staging ring, the host tier, the
    decode streaming slots), where the parts compete for a gpu_device_mem_limit: it planned the streaming slots in the
    device's whole free memory, where the load plans them in what its expert slots (with the tier: its granule-rounded
    mappings) leave, and promised a streaming slot more than the load made."""
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice

    slot, vram = 35328, 1 << 30  # qwen35moe's expert in a device slot; the simulated card
    staging = SimulatedDevice(vram)
    LoadedModel.open(fixture_folder("qwen35moe"), offload=OffloadConfig(device_working_bytes=1 << 20), device=staging)
    ring = staging.memory.by_purpose["prefill staging ring"]
    for path, budget, limit in (("cpu", 2 * slot, ring + 3 * slot), ("tier", 0, ring + (64 << 20) + slot)):
        entries = {"device_expert_bytes": budget, "device_working_bytes": 1 << 20, "gpu_device_mem_limit": limit}
        result = cli("inspect", str(fixture_folder("qwen35moe")), "--json", "--device", "simulated", "--simulated-vram",
                     str(vram), "--decode-path", path, *[a for k, v in entries.items() for a in ("--offload", f"{k}={v}")])
        assert result.returncode == 0, result.stderr
        model = LoadedModel.open(fixture_folder("qwen35moe"), offload=OffloadConfig(**entries), decode_path=path,
                                 device=SimulatedDevice(vram, mem_limit=limit))
        assert model.offload.host_tier == (path == "tier")
        assert json.loads(result.stdout)["offload"]["statements"] == model.offload.plan.statements, path


def test_generate_json_greedy_is_deterministic_and_matches_max_tokens(cli):
    args = ("generate", str(fixture_folder("gptoss")), "--prompt", "Hello", "--max-new-tokens", "12", "--json")
    first, second = cli(*args), run_cli(*args)  # the second in a process of its own: another hash seed, fresh state
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert set(out) == {"prompt_tokens", "tokens", "text", "reasoning", "finish_reason", "timings", "dense"}
    assert out["tokens"] == json.loads(second.stdout)["tokens"]
    assert 1 <= len(out["tokens"]) <= 12
    assert out["timings"]["load_s"] > 0 and out["timings"]["time_to_first_token_s"] > 0


def test_generate_with_approximate_routing_says_its_agreement_with_exact_routing(cli):
    args = ("generate", str(fixture_folder("gptoss")), "--prompt", "Hello", "--max-new-tokens", "6", "--device",
            "simulated", "--offload", "device_expert_bytes=0", "--offload", "min_expert_weight=0.5")
    agreement = json.loads(cli(*args, "--json").stdout)["routing_agreement"]
    text = cli(*args)
    assert text.returncode == 0, text.stderr
    # what it measured: the answer's tokens, and how many of them
    assert text.stderr.rstrip().endswith(
        f"; length; token agreement with exact routing {agreement:.0%} ({round(agreement * 6)} of 6 tokens)]")


def test_generate_under_mode_disabled_routes_exactly_and_warns_that_approximate_routing_does_not_apply(cli):
    args = ("generate", str(fixture_folder("gptoss")), "--prompt", "Hello", "--max-new-tokens", "6", "--json")
    exact = json.loads(cli(*args).stdout)
    disabled = cli(*args, "--device", "simulated", "--offload", "mode=disabled", "--offload", "min_expert_weight=0.5")
    assert disabled.returncode == 0, disabled.stderr
    out = json.loads(disabled.stdout)
    assert out["tokens"] == exact["tokens"] and "routing_agreement" not in out
    warnings = [line for line in disabled.stderr.splitlines() if "min_expert_weight" in line]
    assert warnings == ["warning: min_expert_weight=0.5: no effect under mode=disabled, which offloads nothing: routing "
                        "is exact (approximate routing needs mode=auto or required)"]


def test_generate_raw_skips_the_template(cli):
    raw = json.loads(cli("generate", str(fixture_folder("gptoss")), "--raw", "--prompt", "Hello",
                             "--max-new-tokens", "2", "--json").stdout)
    templated = json.loads(cli("generate", str(fixture_folder("gptoss")), "--prompt", "Hello",
                                   "--max-new-tokens", "2", "--json").stdout)
    assert len(raw["prompt_tokens"]) < len(templated["prompt_tokens"])


def test_generate_raw_begins_as_the_tokenizer_does_and_the_template_has_one_bos(copy_fixture, cli):
    """A tokenizer whose post-processor adds a BOS (Llama's, LFM2's): a raw prompt keeps it, as the tokenizer's own
    encoding (transformers, onnxruntime-genai) gives it; a rendered chat template, which writes its own, gets no
    second one."""
    folder = copy_fixture("gptoss")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|start|>", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|start|>": {"id": "<|start|>", "ids": [1], "tokens": ["<|start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = ("generate", str(folder), "--prompt", "Hello", "--max-new-tokens", "1", "--json")
    raw = json.loads(cli(*args, "--raw").stdout)["prompt_tokens"]
    templated = json.loads(cli(*args).stdout)["prompt_tokens"]
    assert raw[0] == 1 and raw.count(1) == 1 and len(raw) > 1
    assert templated[:2] != [1, 1] and templated[0] == 1 and templated.count(1) == 2  # the template's two <|start|>


def test_chat_reads_more_turns_and_reuses_the_cache(cli):
    result = cli("generate", str(fixture_folder("lfm2moe")), "--chat", "--prompt", "Hi", "--max-new-tokens", "4",
                     "--json", stdin="And then?\nOne more\n")
    assert result.returncode == 0, result.stderr
    turns = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(turns) == 3
    # Later turns feed only the new tokens: the prompt of turn 2 is much shorter than the whole chat.
    assert len(turns[1]["prompt_tokens"]) < len(turns[0]["prompt_tokens"]) + len(turns[0]["tokens"]) + 10


def gptoss_with_context(copy_fixture, tokens: int):
    """A copy of the gptoss fixture whose genai_config.json gives the model a context of `tokens`."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = tokens
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def test_a_chat_whose_conversation_fills_the_context_says_to_run_it_again(copy_fixture, cli):
    """The engine's refusal ends "start a new conversation", which the window's New chat does; generate --chat ends
    there with no way to do that inside it, and said so all the same."""
    folder = gptoss_with_context(copy_fixture, 80)
    result = cli("generate", str(folder), "--chat", "--prompt", "Hello there", "--greedy", "--max-new-tokens", "30",
                 "--json", stdin="Tell me more please now\nagain\n")
    assert [json.loads(line)["finish_reason"] for line in result.stdout.splitlines()] == ["length", "context"]
    assert result.returncode == 2 and re.fullmatch(
        r"moe-workbench: error: the conversation so far \(79 tokens\) and this message \(\d+\) come to \d+ tokens, "
        r"past the model's context of 80: run generate --chat again for a new conversation",
        result.stderr.splitlines()[-1]), result.stderr


def test_chat_turns_from_a_file_with_windows_line_ends_leave_the_carriage_return_out(cli):
    """Standard input is read with its line ends as they are: a turn of a file written on Windows ended '\\r\\n',
    and the user's message the model was given ended with a carriage return."""
    args = ("generate", str(fixture_folder("lfm2moe")), "--chat", "--prompt", "Hi", "--max-new-tokens", "2", "--json",
            "--greedy")
    turns = [[json.loads(line)["prompt_tokens"] for line in cli(*args, stdin=stdin).stdout.splitlines()]
             for stdin in ("And then?\r\n", "And then?\n")]
    assert len(turns[0]) == 2 and turns[0] == turns[1]


def test_generate_json_reports_the_miss_policys_copy_slots_and_later_hits_and_keeps_threads(cli):
    from engine.model_folder import ModelFolder
    from engine.offload.planner import all_resident_bytes

    folder = fixture_folder("gptoss")
    experts = ModelFolder.open(folder).experts
    budget = all_resident_bytes(experts) // 2  # half the experts resident: misses, spare slots, copies
    result = cli("generate", str(folder), "--prompt", "Hello", "--max-new-tokens", "12", "--json",
                     "--device", "simulated", "--offload", f"device_expert_bytes={budget}", "--threads", "1")
    assert result.returncode == 0, result.stderr
    offload = json.loads(result.stdout)["offload"]
    # --threads holds with an offload configuration that leaves cpu_threads automatic
    assert offload["cpu_threads"]["cpu_threads_in_force"] == 1 and not offload["cpu_threads"]["cpu_threads_automatic"]
    assert len(offload["miss_slots"]) == len(experts)
    assert all(0 <= kept <= info.spec.num_experts // 2 for kept, info in zip(offload["miss_slots"], experts))
    reuse = offload["later_hits_per_copy"]
    assert reuse is None or reuse >= 0.0
    assert offload["misses_cpu"] + offload["misses_copied"] > 0


def test_generate_says_when_threads_above_the_cores_are_capped(capsys):
    """--threads above the cores the kernels can take ran on fewer, silently: it says so in one line."""
    import numba

    from engine.ort_env import cpu_threads

    cores = min(cpu_threads(), numba.config.NUMBA_NUM_THREADS)
    status, out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "Hi", "--max-new-tokens",
                             "1", "--threads", str(cores + 7), "--json")
    assert status == 0 and json.loads(out)["tokens"]
    said = [line for line in err.splitlines() if "--threads" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: --threads {cores + 7}: {cores} used, ")
    assert "the CPU expert kernels run on here" in said[0]
    status, _out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "Hi", "--max-new-tokens",
                              "1", "--threads", str(cores), "--json")
    assert status == 0 and "--threads" not in err


def test_generate_says_when_an_offload_cpu_threads_above_the_cores_is_capped(capsys):
    """--offload cpu_threads above the cores ran on fewer without a word, where --threads said so."""
    import numba

    from engine.ort_env import cpu_threads

    cores = min(cpu_threads(), numba.config.NUMBA_NUM_THREADS)
    status, out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "Hi", "--max-new-tokens",
                             "1", "--device", "simulated", "--offload", f"cpu_threads={cores + 7}", "--json")
    assert status == 0 and json.loads(out)["offload"]["cpu_threads"]["cpu_threads_in_force"] == cores
    said = [line for line in err.splitlines() if "cpu_threads" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: cpu_threads={cores + 7}: {cores} used, ")


def test_record_says_when_an_offload_cpu_threads_above_the_cores_is_capped(capsys, tmp_path):
    """generate says so of a cpu_threads above the cores the kernels take; record (as sweep and contention) ran on
    fewer without a word, and measured that count."""
    import numba

    from engine.ort_env import cpu_threads

    cores = min(cpu_threads(), numba.config.NUMBA_NUM_THREADS)
    status, _out, err = _main(capsys, "record", str(fixture_folder("gptoss")), "--scenario", "short",
                              "--max-new-tokens", "1", "--history", str(tmp_path / "h.sqlite"), "--offload",
                              f"cpu_threads={cores + 7}")
    said = [line for line in err.splitlines() if "cpu_threads" in line]
    assert status == 0 and len(said) == 1 and said[0].startswith(f"warning: cpu_threads={cores + 7}: {cores} used, ")


def test_a_decode_path_asked_for_that_is_not_made_is_said(capsys, tmp_path):
    """--decode-path tier where the engine makes no host tier (here: approximate routing, which routes on the host)
    computed cold experts on the CPU; only inspect's plan said so, generate and record not a word."""
    qwen = str(fixture_folder("qwen35moe"))
    said = ("warning: --decode-path tier: Cold experts are computed on the CPU: no host tier is made, since "
            "approximate routing (min_expert_weight=0.1) picks each token's experts on the host, where decode from "
            "the tier routes on the GPU.")
    given = ("--device", "simulated", "--offload", "device_expert_bytes=300000", "--offload", "min_expert_weight=0.1",
             "--decode-path", "tier", "--max-new-tokens", "1")
    status, _out, err = _main(capsys, "generate", qwen, "--prompt", "Hi", "--json", *given)
    assert status == 0 and said in err.splitlines()
    status, _out, err = _main(capsys, "record", qwen, "--scenario", "short", "--history", str(tmp_path / "h.sqlite"),
                              *given)
    assert status == 0 and said in err.splitlines()
    # made as asked: nothing said
    status, _out, err = _main(capsys, "generate", qwen, "--prompt", "Hi", "--json", *given[:4], *given[6:])
    assert status == 0 and "--decode-path" not in err


def test_generate_refuses_threads_beside_a_different_offload_cpu_threads(capsys):
    """--threads 2 beside --offload cpu_threads=1 ran on 1 thread, --threads dropped without a word."""
    status, _out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "Hi", "--max-new-tokens",
                              "1", "--device", "simulated", "--offload", "cpu_threads=1", "--threads", "2")
    assert status != 0 and "--threads 2" in err and "cpu_threads=1" in err and "Traceback" not in err


def test_generate_warns_of_openmp_thread_binding():
    env = {**os.environ, "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    result = subprocess.run([sys.executable, "-m", "app", "generate", str(fixture_folder("gptoss")), "--prompt", "Hi",
                             "--max-new-tokens", "2"], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning: OpenMP thread binding")]
    assert len(warning) == 1 and "OMP_PROC_BIND=close OMP_PLACES=cores" in warning[0]


def test_layer_split_whole_puts_the_budget_on_whole_layers_and_says_so(cli):
    from engine.model_folder import ModelFolder
    from engine.offload.planner import all_resident_bytes

    folder = fixture_folder("gptoss")
    experts = ModelFolder.open(folder).experts
    budget = all_resident_bytes(experts) // 2
    common = ("--device", "simulated", "--offload", f"device_expert_bytes={budget}")
    result = cli("generate", str(folder), "--prompt", "Hello", "--max-new-tokens", "3", "--json",
                     "--layer-split", "whole", *common)
    assert result.returncode == 0, result.stderr
    offload = json.loads(result.stdout)["offload"]
    assert offload["layer_split"]["mode"] == "whole" and offload["layer_split"]["whole_layers"] is True
    assert any(text.startswith("The budget holds whole layers:") for text in offload["statements"])
    inspected = json.loads(cli("inspect", str(folder), "--json", "--layer-split", "whole", *common).stdout)
    counts = sorted(inspected["offload"]["slots"].values())
    assert set(counts) == {0, experts[0].spec.num_experts}, counts
    refused = cli("generate", str(folder), "--prompt", "Hi", "--layer-split", "layers", *common)
    assert refused.returncode != 0 and "invalid choice: 'layers'" in refused.stderr


# --- the command line's own checks (in this process: main() returns the exit status) -----------------------------

def _main(capsys, *args):
    from app.cli import main

    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_write_model_keeps_what_a_folder_holds_unless_forced(tmp_path, capsys):
    target = tmp_path / "model"
    small = ("--layers", "1", "--hidden", "64", "--experts", "4", "--intermediate", "64")
    assert _main(capsys, "write-model", str(target), *small)[0] == 0
    before = (target / "model.onnx").read_bytes()
    status, _out, err = _main(capsys, "write-model", str(target), *small, "--seed", "1")
    assert status == 2 and err.strip() == (f"moe-workbench: error: {target}: holds files already; writing would replace "
                                           "its model (--force to do so)")
    assert (target / "model.onnx").read_bytes() == before
    assert _main(capsys, "write-model", str(target), *small, "--seed", "1", "--force")[0] == 0
    assert _main(capsys, "write-model", str(target / "model.onnx"), *small)[2].strip().endswith(
        "model.onnx: a file, not a folder")


def test_write_model_says_in_one_line_where_the_folder_cannot_be_made_or_written(tmp_path, capsys, monkeypatch):
    """A folder under a file, or a disk that fills while the weights are written, ended in an internal error (the
    OSError's type and errno): each is the user's to fix, said in one line naming the folder, the partial data
    removed."""
    import errno

    import engine.writer.write

    small = ("--layers", "1", "--hidden", "64", "--experts", "4", "--intermediate", "64")
    (tmp_path / "notes.txt").write_text("a file")
    under_a_file = tmp_path / "notes.txt" / "model"
    status, _out, err = _main(capsys, "write-model", str(under_a_file), *small)
    assert status == 2 and err == f"moe-workbench: error: {under_a_file}: not written (Not a directory)\n"

    def full(file, *_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.name)

    monkeypatch.setattr(engine.writer.write, "write_tensors", full)
    status, _out, err = _main(capsys, "write-model", str(tmp_path / "model"), *small)
    assert status == 2 and err == f"moe-workbench: error: {tmp_path / 'model'}: not written (No space left on device)\n"
    assert not (tmp_path / "model" / "model.onnx.data.partial").exists()


def _listing(folder):
    """Every file and folder under `folder`, with the files' bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() if path.is_file() else None
            for path in sorted(folder.rglob("*"))}


def test_write_model_that_fails_partway_leaves_the_folder_as_it_was(tmp_path, capsys, monkeypatch):
    """A write that failed partway left what it had written (the tokenizer files, a new folder), and a --force write
    had replaced the model's tokenizer files before the disk filled: a model of two writes. The folder is left as
    it was before the command: the files and folders it made removed, the files there untouched."""
    import errno

    import engine.writer.write

    small = ("--layers", "1", "--hidden", "64", "--experts", "4", "--intermediate", "64")
    model = tmp_path / "kept"
    assert _main(capsys, "write-model", str(model), *small)[0] == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    before = _listing(tmp_path)

    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for step in ("write_tensors", "readme"):  # the weights, half way; the last file, every other one written
        with monkeypatch.context() as patch:
            patch.setattr(engine.writer.write, step, full)
            for folder in (tmp_path / "new" / "deeper", model, tmp_path / "mine"):
                status, _out, err = _main(capsys, "write-model", str(folder), *small, "--seed", "1", "--force")
                assert (step, status, err) == (step, 2, f"moe-workbench: error: {folder}: not written (No space left "
                                                        "on device)\n")
                assert _listing(tmp_path) == before


def test_write_model_names_the_partial_files_a_killed_write_left(tmp_path, capsys):
    """A write killed partway (its process ended, no cleanup run) leaves its partial files; the next write into the
    folder said only that it holds files. It names them; --force writes over them."""
    from engine.writer.write import FILE_NAMES

    small = ("--layers", "1", "--hidden", "64", "--experts", "4", "--intermediate", "64")
    target = tmp_path / "killed"
    target.mkdir()
    (target / "model.onnx.data.partial").write_bytes(b"half")
    (target / "tokenizer.json.partial").write_text("{")
    before = _listing(tmp_path)
    status, _out, err = _main(capsys, "write-model", str(target), *small)
    assert status == 2 and err == (f"moe-workbench: error: {target}: holds files already; writing would replace its "
                                   "model (--force to do so); tokenizer.json.partial, model.onnx.data.partial: left "
                                   "by a write that did not finish\n")
    assert _listing(tmp_path) == before
    assert _main(capsys, "write-model", str(target), *small, "--force")[0] == 0
    assert sorted(path.name for path in target.iterdir()) == sorted(FILE_NAMES)


def test_write_model_refuses_weights_larger_than_the_disk_has_free_before_writing(tmp_path, capsys, monkeypatch):
    """A size mistyped (--experts 320 for 32: 112 GiB of weights) was written until the disk filled, an hour on, then
    failed. The weights' size is checked against the disk's free space first."""
    import shutil

    from engine.writer import WriterSpec, model_data_bytes

    small = ("--layers", "1", "--hidden", "64", "--experts", "4", "--intermediate", "64")
    weights = model_data_bytes(WriterSpec(layers=1, hidden_size=64, num_experts=4, inter_size=64))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=weights - 1))
    status, _out, err = _main(capsys, "write-model", str(tmp_path / "model"), *small)
    assert status == 2 and err == (f"moe-workbench: error: {tmp_path / 'model'}: not written: its weights take "
                                   f"{human_bytes(weights)}, more than the {human_bytes(weights - 1)} free on the disk "
                                   "there\n")
    assert not (tmp_path / "model").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=weights))
    assert _main(capsys, "write-model", str(tmp_path / "model"), *small)[0] == 0
    assert (tmp_path / "model" / "model.onnx.data").stat().st_size == weights


def test_write_model_checks_its_sizes_before_building_a_graph_of_every_layer(tmp_path, capsys, monkeypatch):
    """--layers 100000000 filled the memory with its graph (146 KiB a layer) before the disk's free space was checked,
    and was killed. The sizes are counted on graphs of a few layers, before anything is built: weights larger than
    the disk's free space, a graph past protobuf's 2 GiB or one whose build takes more memory than is available are
    refused at once."""
    import shutil
    from dataclasses import replace
    from types import SimpleNamespace

    import psutil

    import engine.writer.write as write
    from engine.writer import WriterSpec

    real_build = write.build_graph

    def build_graph(spec):  # (a graph of every layer: minutes, then the memory filled)
        assert spec.layers <= 4, f"a graph of {spec.layers} layers built"
        return real_build(spec)

    monkeypatch.setattr(write, "build_graph", build_graph)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=1 << 40))
    target = tmp_path / "model"
    status, _out, err = _main(capsys, "write-model", str(target), "--layers", "100000000")
    assert status == 2 and err == (f"moe-workbench: error: {target}: not written: its weights take 27.2 TiB, more "
                                   "than the 1.0 TiB free on the disk there\n")
    from engine.writer.write import write_sizes

    tiny = ("--hidden", "16", "--intermediate", "16", "--experts", "2", "--top-k", "1", "--heads", "2", "--kv-heads",
            "1", "--head-size", "16", "--block-size", "16")
    spec = WriterSpec(hidden_size=16, inter_size=16, num_experts=2, top_k=1, num_heads=2, num_kv_heads=1, head_size=16,
                      block_size=16)
    graph = write_sizes(replace(spec, layers=1000000)).graph_bytes
    status, _out, err = _main(capsys, "write-model", str(target), "--layers", "1000000", *tiny)
    assert status == 2 and err == (f"moe-workbench: error: {target}: not written: its graph of 1000000 layers "
                                   f"(model.onnx) takes about {human_bytes(graph)}, past the 2.0 GiB one protobuf "
                                   "file holds\n")
    sizes = write_sizes(replace(spec, layers=500))
    memory = sizes.memory_bytes
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=memory - 1))
    status, _out, err = _main(capsys, "write-model", str(target), "--layers", "500", *tiny)
    assert status == 2 and err == (f"moe-workbench: error: {target}: not written: writing it takes about "
                                   f"{human_bytes(memory)} of memory, more than the {human_bytes(memory - 1)} "
                                   f"available (its graph of 500 layers about {human_bytes(sizes.graph_memory_bytes)}; "
                                   f"its weights, made a piece at a time, about {human_bytes(sizes.stream_bytes)}: a "
                                   "piece of cos_cache is 64.0 KiB)\n")
    assert not target.exists()
    monkeypatch.setattr(write, "build_graph", real_build)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=memory))
    assert _main(capsys, "write-model", str(target), "--layers", "500", *tiny)[0] == 0


def test_write_model_counts_the_memory_its_weights_pieces_take_before_making_any(tmp_path, capsys, monkeypatch):
    """write-model's memory check counted the graph alone: --hidden 10000000 (its disk space free) wrote for minutes,
    then ran out of memory making an expert's codes of 1.2 GiB; --heads 1000000 planned its graph with an array of a
    gain for each of 32 million rows, before any check. The memory the weights' pieces take as they are made and
    queued for the disk is counted too, before anything is made, within what the process may still map (ulimit -v)."""
    import shutil
    import tracemalloc
    from types import SimpleNamespace

    import psutil

    import engine.writer
    from engine.writer import WriterSpec
    from engine.writer.write import write_sizes

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=1 << 40))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 << 30))
    written = []
    monkeypatch.setattr(engine.writer, "write_model", lambda folder, spec: written.append(spec) or Path(folder))
    target = tmp_path / "model"
    sizes = write_sizes(WriterSpec(hidden_size=10000000))
    tracemalloc.start()
    status, _out, err = _main(capsys, "write-model", str(target), "--hidden", "10000000")
    assert tracemalloc.get_traced_memory()[1] < 64 << 20
    tracemalloc.stop()
    assert status == 2 and err == (f"moe-workbench: error: {target}: not written: writing it takes about "
                                   f"{human_bytes(sizes.memory_bytes)} of memory, more than the 4.0 GiB available "
                                   f"(its graph of 2 layers about {human_bytes(sizes.graph_memory_bytes)}; its "
                                   f"weights, made a piece at a time, about {human_bytes(sizes.stream_bytes)}: a "
                                   "piece of model.layers.0.moe.experts.gate_up_proj.qweight is 1.2 GiB)\n")
    assert sizes.memory_bytes > 7 << 30 and not written  # (an expert's codes, 3.5 times them made, 3 queued)
    tracemalloc.start()
    assert _main(capsys, "write-model", str(target), "--heads", "1000000", "--kv-heads", "1")[0] == 0
    assert tracemalloc.get_traced_memory()[1] < 64 << 20 and written[-1].num_heads == 1000000
    tracemalloc.stop()
    # under ulimit -v, what the process may still map is what is available
    vms = psutil.Process().memory_info().vms
    monkeypatch.setattr(psutil.Process, "rlimit", lambda _self, _what: (vms + (1 << 30), psutil.RLIM_INFINITY))
    status, _out, err = _main(capsys, "write-model", str(target), "--hidden", "2000000")
    assert status == 2 and "of memory, more than the 1.0 GiB available (" in err, err


def test_write_model_says_which_layout_options_its_quant_type_does_not_use(tmp_path, capsys):
    """--bits and --block-size with fp4 (MXFP4's block is 32) or --nvfp4-packing with int experts were taken in
    silence: the folder held another layout than the options read. Each is said to do nothing there."""
    small = ("--layers", "1", "--hidden", "64", "--experts", "4", "--intermediate", "64")
    status, _out, err = _main(capsys, "write-model", str(tmp_path / "a"), *small, "--quant-type", "fp4", "--bits", "8",
                              "--block-size", "64")
    assert status == 0 and err == ("warning: --bits, --block-size: no effect with --quant-type fp4 (fp4 has blocks of "
                                   "32 4-bit values)\n")
    status, _out, err = _main(capsys, "write-model", str(tmp_path / "b"), *small, "--nvfp4-packing", "n_packed")
    assert status == 0 and err == "warning: --nvfp4-packing: no effect with --quant-type int\n"
    status, _out, err = _main(capsys, "write-model", str(tmp_path / "c"), *small, "--quant-type", "fp8", "--bits", "4",
                              "--block-size", "32")
    assert status == 0 and err == "warning: --bits: no effect with --quant-type fp8 (fp8 is e4m3)\n"
    status, _out, err = _main(capsys, "write-model", str(tmp_path / "d"), *small, "--bits", "8", "--block-size", "0")
    assert status == 0 and err == ""


def test_a_sweep_says_it_sets_the_expert_budget_given_at_each_point(tmp_path, capsys, monkeypatch):
    """A sweep tries budgets from none to every expert: a device_expert_bytes given (or its alias) was replaced at
    every point without a word, as though it had bounded the sweep; then its warning said "no effect on a sweep",
    though the model loads with that budget and answers its warm-up before the first point at it. It says so."""
    loaded = timed_sweep_warm_up(monkeypatch)
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--history",
                             str(tmp_path / "h.sqlite"), "--points", "2", "--max-new-tokens", "1", "--scenario",
                             "short", "--repeats", "1", "--offload", "gpu_budget_bytes=70656", "--json")
    assert status == 0 and ("warning: device_expert_bytes=70656: a sweep sets the expert budget at each point; this "
                            "one sets only the budget the model loads with, at which it gives its unrecorded warm-up "
                            "answer before the first point") in err.splitlines()
    assert loaded == [70656] and json.loads(out)["warm_up"]["budget_bytes"] == 70656  # (two experts' slots)


def test_a_sweep_prints_its_warm_up_before_the_first_point_beside_its_points(tmp_path, capsys, monkeypatch):
    """The sweep's unrecorded answer at the loaded budget before its first point was printed nowhere, nor saved: what
    it cost could not be told. Its line (the JSON's "warm_up") says it beside the points, a stopped sweep's too."""
    loaded = timed_sweep_warm_up(monkeypatch)
    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--history", str(tmp_path / "h.sqlite"),
            "--points", "2", "--max-new-tokens", "1", "--scenario", "short", "--repeats", "1")
    status, out, _err = _main(capsys, *args, "--json")
    # the automatic budget, far above every expert's 552 KiB: every expert resident
    assert status == 0 and loaded[0] > 565248
    assert json.loads(out)["warm_up"] == {"budget_bytes": loaded[0], "fraction": 1.0, "seconds": 0.0451}
    _sweep_run_raises(monkeypatch, 1, RuntimeError("failed"))
    status, out, err = _main(capsys, *args, "--offload", "device_expert_bytes=282624")
    assert status == 3 and out == "" and (
        "sweep: warm-up before the first point, not recorded: an answer of up to 4 tokens at the model's loaded "
        "budget, budget share 50% (device_expert_bytes=282624), took 45.1 ms") in err.splitlines()


def test_a_sweep_says_the_warm_up_every_run_of_a_point_follows(tmp_path, capsys):
    """A point's unrecorded answer at its budget was said by its first record alone: a line and each JSON row say what
    every point's took, which all its runs follow, and each record says it."""
    history = str(tmp_path / "h.sqlite")
    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--history", history, "--points", "2",
            "--max-new-tokens", "1", "--scenario", "short", "--repeats", "2")
    status, out, _err = _main(capsys, *args, "--json")
    rows = json.loads(out)["points"]
    assert status == 0 and all(row["warm_up_s"] > 0 for row in rows)
    status, out, _err = _main(capsys, "history", "--history", history, "--id", *map(str, rows[1]["record_ids"]))
    assert [record["timings"]["point_warm_up_s"] for record in json.loads(out)] == [rows[1]["warm_up_s"]] * 2
    status, _out, err = _main(capsys, *args)
    assert status == 0 and re.search(r"^sweep: every run of a point follows its unrecorded warm-up answer at the "
                                     r"point's budget \(its records' point_warm_up_s\), which took: budget share 0%: "
                                     r"[\d.]+ [mµ]?s, budget share 100%: [\d.]+ [mµ]?s$", err, re.MULTILINE)


def test_sweep_checks_its_arguments_before_it_runs(tmp_path, capsys):
    gptoss = str(fixture_folder("gptoss"))
    common = ("--device", "simulated", "--history", str(tmp_path / "h.sqlite"))
    status, _out, err = _main(capsys, "sweep", gptoss, *common, "--plot", str(tmp_path / "plot.txt"))
    assert status == 2 and "plot.txt: name the file .png or .svg" in err
    status, _out, err = _main(capsys, "sweep", gptoss, *common, "--plot", str(tmp_path / "no" / "plot.png"))
    assert status == 2 and f"no folder {tmp_path / 'no'}" in err
    (tmp_path / "sweep.png").mkdir()  # found only once the whole sweep had run: "Qt's writer made no file"
    status, _out, err = _main(capsys, "sweep", gptoss, *common, "--plot", str(tmp_path / "sweep.png"))
    assert status == 2 and err == f"moe-workbench: error: --plot {tmp_path / 'sweep.png'}: a folder, not a file\n"
    status, _out, err = _main(capsys, "sweep", gptoss, *common, "--margin", "-1")
    assert status == 2 and "--margin -1: a share of the fastest completion" in err
    for margin in ("nan", "inf"):  # nan ran the whole sweep, then failed to recommend: an internal error
        status, _out, err = _main(capsys, "sweep", gptoss, *common, "--margin", margin)
        assert status == 2 and f"--margin {margin}: a share of the fastest completion" in err
    assert not (tmp_path / "h.sqlite").exists()  # refused before anything ran or was saved


def test_an_empty_configuration_name_is_refused_not_ignored(tmp_path, capsys):
    """`--save-as ""` (a script's unset variable) ran the whole sweep and saved nothing, saying nothing of it, and
    `--config ""` started from no saved configuration, silently: both are refused before anything runs."""
    import pytest

    gptoss = str(fixture_folder("gptoss"))
    for args in (("sweep", gptoss, "--device", "simulated", "--history", str(tmp_path / "h.sqlite"), "--save-as", " "),
                 ("generate", gptoss, "--prompt", "Hi", "--config", "")):
        with pytest.raises(SystemExit) as exit:
            _main(capsys, *args)
        option = args[-2]
        assert exit.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: argument {option}: a configuration needs a "
                                                                 "name")
    assert not (tmp_path / "h.sqlite").exists()


def test_an_offload_setting_without_its_key_or_value_says_the_form_it_takes(capsys):
    """`--offload =5` (the key left out) was "unknown offload key ''" followed by every key there is."""
    gptoss = str(fixture_folder("gptoss"))
    for item in ("=5", "device_expert_bytes", "="):
        status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", item)
        assert status == 2 and err == f"moe-workbench: error: --offload '{item}': expected KEY=VALUE\n"


def test_an_empty_path_is_refused_not_taken_for_the_current_folder_or_none(tmp_path, capsys, monkeypatch):
    """An empty path (a script's unset variable) was the current folder to `inspect ""` ("./genai_config.json:
    missing") and to `write-model "" --force`, which replaced a model there; `gui ""` opened the demo model, `--plot
    ""` ran the whole sweep and drew nothing, `--history ""` and `--corpus ""` used the defaults: all without a word.
    Each is refused as the options are read, naming the argument."""
    gptoss = str(fixture_folder("gptoss"))
    monkeypatch.chdir(tmp_path)
    history = str(tmp_path / "h.sqlite")
    for args, argument in ((("gui", ""), "model"), (("inspect", " "), "model"),
                           (("generate", "", "--prompt", "Hi"), "model"), (("write-model", "", "--force"), "folder"),
                           (("record", gptoss, "--history", ""), "--history"),
                           (("history", "--history", ""), "--history"),
                           (("sweep", gptoss, "--device", "simulated", "--history", history, "--plot", ""), "--plot"),
                           (("contention", gptoss, "--corpus", ""), "--corpus")):
        with pytest.raises(SystemExit) as exit:
            _main(capsys, *args)
        assert exit.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (f"moe-workbench {args[0]}: error: argument {argument}: an "
                                                            "empty path names no file or folder")
    assert list(tmp_path.iterdir()) == []  # nothing written, no history made


def test_contention_checks_its_corpus_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A corpus folder that is not there (or holds no .txt file) was found only once the model had loaded: minutes on
    a large one. It is refused first, in one line naming the folder."""
    import engine.generation

    def no_load(*_args, **_kwargs):
        raise AssertionError("the model loaded before the corpus was checked")

    monkeypatch.setattr(engine.generation.LoadedModel, "open", no_load)
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "contention", gptoss, "--corpus", str(tmp_path / "none"))
    assert status == 2 and err == f"moe-workbench: error: --corpus {tmp_path / 'none'}: no such folder\n"
    (tmp_path / "notes.md").write_text("not a .txt")
    status, _out, err = _main(capsys, "contention", gptoss, "--corpus", str(tmp_path))
    assert status == 2 and err == f"moe-workbench: error: --corpus {tmp_path}: no .txt files to index\n"
    # a process is spawned each: the window's bound (--workers 10**18 hung, building a shard a worker)
    for workers in ("257", str(10**18)):
        with pytest.raises(SystemExit) as refused:  # argparse's refusal
            _main(capsys, "contention", gptoss, "--corpus", str(tmp_path), "--workers", workers)
        assert refused.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
            f"moe-workbench contention: error: argument --workers: {workers}: must be at most 256")


def test_contention_answers_as_asked_and_its_report_says_how(tmp_path, capsys):
    """contention answered greedily whatever was asked, with none of record's and sweep's sampling options: it takes
    them, says on standard error how it samples, and its report keeps how its answers were asked for."""
    from engine.records.contention import make_corpus

    corpus = make_corpus(tmp_path / "corpus", files=4, words_per_file=60)
    status, out, err = _main(capsys, "contention", str(fixture_folder("gptoss")), "--corpus", str(corpus),
                             "--workers", "1", "--max-new-tokens", "2", "--temperature", "0.7", "--top-k", "5",
                             "--seed", "3", "--json")
    assert status == 0 and "contention: sampling: temperature 0.7, top-k 5, seed 3" in err
    generation = json.loads(out)["generation"]
    assert (generation["do_sample"], generation["temperature"], generation["top_k"], generation["seed"],
            generation["max_new_tokens"]) == (True, 0.7, 5, 3, 2)
    status, out, _err = _main(capsys, "contention", str(fixture_folder("gptoss")), "--corpus", str(corpus),
                              "--workers", "1", "--max-new-tokens", "2")
    assert status == 0 and "Answers: greedy, at most 2 tokens each." in out


def test_contentions_report_names_the_scenario_its_inference_ran(tmp_path, capsys, monkeypatch):
    """The report's inference row read "inference" whatever --scenario asked, and the JSON did not say it either: a
    saved report of the multiturn chat's six answers read as one of the short question's single answer."""
    import engine.records.contention as contention
    from engine.records.contention import make_corpus

    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: (4, 0.5))  # the inference's row is read
    corpus = make_corpus(tmp_path / "corpus", files=4, words_per_file=60)
    run = ("contention", str(fixture_folder("gptoss")), "--corpus", str(corpus), "--max-new-tokens", "2")
    status, out, _err = _main(capsys, *run, "--scenario", "multiturn")
    assert status == 0 and re.search(r"^\| inference \(multiturn\) \| [0-9.]+ m?s \| [0-9.]+ m?s \| [0-9.]+x"
                                     r"( \((faster|slower)\))? \|$", out, re.MULTILINE), out
    status, out, _err = _main(capsys, *run, "--json")
    assert status == 0 and json.loads(out)["scenario"] == "short"


def test_contention_on_a_terminal_names_the_phase_that_runs_and_ends_its_line_before_a_refusal(
        copy_fixture, tmp_path, capsys, monkeypatch):
    """On a terminal contention's line read "contention:  20.0%" and so on, drawn only as each phase ended: nothing
    while the first ran, and never which phase ran (the window's bar names it; the indexing warm-up alone takes minutes
    on the default corpus). It names the phase from the start; a refusal is said below it, not on its end."""
    import engine.records.contention as contention
    from engine.records.contention import make_corpus

    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: (4, 0.5))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    corpus = make_corpus(tmp_path / "corpus", files=4, words_per_file=60)
    status, _out, err = _main(capsys, "contention", str(fixture_folder("gptoss")), "--corpus", str(corpus),
                              "--max-new-tokens", "2")
    assert status == 0 and err == ("\rcontention:   0.0%, warming up: inference"
                                   "\rcontention:  20.0%, warming up: indexing "
                                   "\rcontention:  40.0%, indexing alone       "
                                   "\rcontention:  60.0%, inference alone      "
                                   "\rcontention:  80.0%, indexing and inference at once"
                                   f"\r{'contention: 100.0%':50}\n")
    folder = gptoss_with_context(copy_fixture, 80)
    status, _out, err = _main(capsys, "contention", str(folder), "--corpus", str(corpus), "--scenario", "multiturn",
                              "--max-new-tokens", "30")
    assert status == 2 and err.startswith("\rcontention:   0.0%, warming up: inference\nmoe-workbench: error: "
                                          "multiturn: the conversation so far ("), err


def test_contentions_report_names_the_model_and_the_device_and_says_the_cpu_stands_in_for_a_simulated_card(tmp_path,
                                                                                                          capsys):
    """contention's report named neither the model nor the device; on the simulated GPU its inference times are the
    CPU's, which computes the card's experts too, and unlike record's line it did not say so."""
    from engine.records.contention import make_corpus

    corpus = make_corpus(tmp_path / "corpus", files=4, words_per_file=60)
    gptoss = fixture_folder("gptoss")
    run = ("contention", str(gptoss), "--corpus", str(corpus), "--workers", "1", "--max-new-tokens", "2")
    status, out, _err = _main(capsys, *run, "--device", "simulated", "--simulated-vram", "1GiB")
    assert status == 0 and out.startswith(
        f"Model {gptoss.resolve()}, on the simulated GPU, 1.0 GiB. The CPU computes the simulated card's experts too, "
        "standing in for it: the inference times are the CPU's, not the card's.\n\n| workload |")
    status, out, _err = _main(capsys, *run, "--json", "--device", "simulated", "--simulated-vram", "1GiB")
    report = json.loads(out)
    assert status == 0 and (report["model"], report["device"], report["simulated"]) == (
        str(gptoss.resolve()), "simulated GPU, 1.0 GiB", True)
    status, out, _err = _main(capsys, *run)
    assert status == 0 and out.startswith(f"Model {gptoss.resolve()}, on the CPU.\n\n| workload |")


def test_contentions_report_says_why_the_inference_ran_on_the_cpu_where_the_cuda_gpu_cannot_be_used(tmp_path, capsys,
                                                                                                    monkeypatch):
    """contention --device cuda on a GPU it cannot use (mode=auto) timed the inference with every expert on the CPU,
    and said why on standard error alone: its report (the JSON, the Markdown) read as a run that chose the CPU. The
    report now keeps why, as record's records do (device_fallback). A stand-in for a CUDA GPU another process holds."""
    from engine.offload import cuda_device
    from engine.records.contention import make_corpus

    busy = ("CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable device(s) "
            "is/are busy or unavailable)")
    note = f"The CUDA GPU was asked for but cannot be used ({busy}); every expert runs on the CPU instead."
    monkeypatch.setattr(cuda_device, "cuda_device_or_cpu", lambda mem_limit, mode, report, kernels=True: (None, note))
    corpus = make_corpus(tmp_path / "corpus", files=4, words_per_file=60)
    run = ("contention", str(fixture_folder("gptoss")), "--corpus", str(corpus), "--workers", "1", "--max-new-tokens",
           "2", "--device", "cuda")
    status, out, err = _main(capsys, *run, "--json")
    assert status == 0 and err.splitlines()[0] == (f"warning: the CUDA GPU was asked for but cannot be used ({busy}); "
                                                   "every expert runs on the CPU instead")
    assert json.loads(out)["device_fallback"] == note
    status, out, _err = _main(capsys, *run)
    assert status == 0 and f" at most 2 tokens each.\n\n{note}\n\n" in out
    status, out, _err = _main(capsys, *run[:-2], "--json")  # the CPU chosen: nothing to say
    assert status == 0 and json.loads(out)["device_fallback"] is None


def _sweep_run_raises(monkeypatch, at: int, error: BaseException) -> None:
    """The sweep's `at`-th recorded run (a point's three repeats, after its unrecorded warm-up answers) raises `error`;
    those before it run."""
    import engine.records.sweep as sweep

    run_scenario, calls = sweep.run_scenario, []

    def run(*args, **kwargs):
        if kwargs.get("label"):  # the warm-ups have none
            calls.append(kwargs["label"])
            if len(calls) == at:
                raise error
        return run_scenario(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_scenario", run)


def test_an_interrupted_sweep_keeps_the_runs_of_its_finished_points(tmp_path, capsys, monkeypatch):
    from engine.records.history import History

    _sweep_run_raises(monkeypatch, 7, KeyboardInterrupt())  # two points' three runs each, then Ctrl-C
    history = tmp_path / "h.sqlite"
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                             "--max-new-tokens", "2", "--history", str(history))
    assert [row["label"] for row in History(history).rows()] == (["sweep budget share 50%"] * 3  # newest first
                                                                 + ["sweep budget share 0%"] * 3)
    # the finished points printed (it printed none) and where it stopped said (it said only "interrupted")
    assert status == 130 and err.splitlines()[-1] == (
        "moe-workbench: the sweep was interrupted at budget share 100% (device_expert_bytes=565248), point 3 of 3; the "
        "2 points before it are printed, their 6 runs saved in the history (ids 1 to 6); no recommendation")
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["0", "282624"] and "recommended" not in out


def test_a_stopped_sweep_names_its_runs_ids_where_another_process_saved_runs_between_its_points(
        tmp_path, capsys, monkeypatch):
    """The stop line said "ids 1 to 7" for a sweep's 6 runs where another process (a record on the same history)
    saved run 4 between its points: `history --id 1 2 3 4 5 6 7` would open one not the sweep's. It names the ids as
    saved, consecutive ones as a range."""
    import engine.records.sweep as sweep
    from engine.records.history import History

    history = tmp_path / "h.sqlite"
    run_scenario, calls = sweep.run_scenario, []

    def run(*args, **kwargs):
        if kwargs.get("label"):
            calls.append(kwargs["label"])
            if len(calls) == 4:  # the second point's first run: the first point's runs are saved, ids 1 to 3
                History(history).add(History(history).get(1))
            if len(calls) == 7:
                raise KeyboardInterrupt()
        return run_scenario(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_scenario", run)
    status, _out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points",
                              "3", "--max-new-tokens", "2", "--history", str(history))
    assert status == 130 and err.splitlines()[-1].endswith(
        "the 2 points before it are printed, their 6 runs saved in the history (ids 1 to 3, 5 to 7); no recommendation")
    # the points printed say what their device peaks are made of, as a complete sweep's do
    parts = err.splitlines()[-2]
    assert parts.startswith("sweep: device peak by part: budget share 0%: ") and "; budget share 50% spread: " in parts


def test_a_sweep_whose_point_fails_names_that_point_and_prints_the_points_before_it(tmp_path, capsys, monkeypatch):
    """A point that raised: the command said only "internal error: RuntimeError: CUDA out of memory while staging",
    not which budget failed, and printed none of the points it had finished (their runs were saved). It prints them,
    without a recommendation, and says in one line which point failed (its share and device_expert_bytes), in which
    of its runs, and why."""
    _sweep_run_raises(monkeypatch, 7, RuntimeError("CUDA out of memory while staging\nthe allocator's details"))
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                             "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"))
    assert status == 3 and err.splitlines()[-1] == (
        "moe-workbench: internal error: the sweep failed at budget share 100% (device_expert_bytes=565248), point 3 "
        "of 3, in its short run (repeat 1 of 3): "
        "RuntimeError: CUDA out of memory while staging; the 2 points before it are printed, their 6 runs saved in "
        "the history (ids 1 to 6); no recommendation")
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows == ["0", "282624"] and "recommended" not in out


def test_a_sweep_stopped_on_a_terminal_starts_its_points_and_its_line_below_the_progress_drawn(
        tmp_path, capsys, monkeypatch):
    """On a terminal the progress line is redrawn in place ("\\rsweep:  33.3%", no newline): a sweep interrupted
    there printed its points' header and its stop line on the end of that line ("sweep:  33.3%moe-workbench: the sweep
    was interrupted…"). The progress line is ended first."""
    _sweep_run_raises(monkeypatch, 4, KeyboardInterrupt())
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    status, _out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                              "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"))
    # the warm-up and the point's parts, below the progress line
    assert status == 130 and "\rsweep:  33.3%\nsweep: warm-up before the first point, " in err
    assert "\nsweep: device peak by part: budget share 0%: " in err
    assert err.endswith("\nmoe-workbench: the sweep was interrupted at budget share 50% (device_expert_bytes=282624), "
                        "point 2 of 3; the 1 point before it is printed, its 3 runs saved in the history (ids 1 to 3); "
                        "no recommendation\n")


def test_a_sweep_point_the_history_could_not_save_is_kept_in_a_file_it_names(tmp_path, capsys, monkeypatch):
    """A point whose runs the history could not save (a full disk, here another process's write held past the
    timeout) ended the sweep with its measurements lost: the table printed only the points before it, and its runs
    were nowhere. They are kept in a file of their own, which the error line names."""
    import sqlite3
    import tempfile

    import engine.records.sweep as sweep
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    monkeypatch.setattr(History, "_connect", lambda self: sqlite3.connect(self.path, timeout=0.1))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = sqlite3.connect(path, isolation_level=None)
    run_scenario = sweep.run_scenario

    def run(*args, **kwargs):
        # the second point's runs begin
        if kwargs.get("label") == "sweep budget share 100%" and not other.in_transaction:
            other.execute("BEGIN EXCLUSIVE")
        return run_scenario(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_scenario", run)
    try:
        status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points",
                                 "2", "--max-new-tokens", "2", "--history", str(path))
    finally:
        other.close()
    (kept,) = tmp_path.glob("moe-workbench-unsaved-runs-*.json")
    assert status == 2 and len(out.splitlines()) == 3  # the simulated card's note, the heading, the first point
    assert err.splitlines()[-1] == (
        "moe-workbench: error: the sweep failed at budget share 100% (device_expert_bytes=565248), point 2 of 2: "
        f"{path}: the runs were not saved (another process holds it locked: database is locked); the 3 runs measured "
        f"are kept in {kept}; the 1 point before it is printed, its 3 runs saved in the history (ids 1 to 3); no "
        "recommendation")
    runs = json.loads(kept.read_text())
    assert [run["label"] for run in runs] == ["sweep budget share 100%"] * 3
    assert all(run["timings"]["completion_s"] for run in runs)
    assert [row["label"] for row in History(path).rows()] == ["sweep budget share 0%"] * 3


def test_a_sweep_point_whose_save_fails_partway_is_kept_whole_in_the_file_not_counted_under_the_points_before(
        tmp_path, capsys, monkeypatch):
    """The history took the second point's first run and then refused its second (a full disk; here a trigger that
    aborts the fifth insert): the stop line said "the 1 point before it is printed, its 4 runs saved (ids 1 to 4)",
    counting a run of the point that failed under the point before it, and the file kept only that point's other two
    runs. A point's runs are saved together or not at all: the line counts the first point's 3 runs, and the file
    keeps all 3 of the point that failed."""
    import sqlite3
    import tempfile

    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    History(path)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TRIGGER full BEFORE INSERT ON runs WHEN (SELECT count(*) FROM runs) >= 4 "
                   "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                             "--max-new-tokens", "2", "--history", str(path))
    (kept,) = tmp_path.glob("moe-workbench-unsaved-runs-*.json")
    assert status == 2 and len(out.splitlines()) == 3  # the simulated card's note, the heading, the first point
    assert err.splitlines()[-1] == (
        "moe-workbench: error: the sweep failed at budget share 100% (device_expert_bytes=565248), point 2 of 2: "
        f"{path}: the runs were not saved (database or disk is full); the 3 runs measured are kept in {kept}; "
        "the 1 point before it is printed, its 3 runs saved in the history (ids 1 to 3); no recommendation")
    assert [run["label"] for run in json.loads(kept.read_text())] == ["sweep budget share 100%"] * 3
    assert [row["label"] for row in History(path).rows()] == ["sweep budget share 0%"] * 3


def test_a_stopped_sweep_says_it_wrote_no_plot_and_saved_no_configuration(tmp_path, capsys, monkeypatch):
    """Asked for --plot and --save-as, a sweep interrupted at its second point wrote neither (it has no recommendation)
    and did not say so: its last line read as if the sweep's work were done but for the points left."""
    from engine.records import configurations

    monkeypatch.setattr(configurations, "default_path", lambda: tmp_path / "configurations.json")
    _sweep_run_raises(monkeypatch, 4, KeyboardInterrupt())
    status, _out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                              "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"), "--save-as", "quick",
                              "--plot", str(tmp_path / "sweep.png"))
    assert status == 130 and err.splitlines()[-1].endswith(
        "its 3 runs saved in the history (ids 1 to 3); no recommendation: no plot written, no configuration 'quick' "
        "saved")
    assert not (tmp_path / "sweep.png").exists() and not (tmp_path / "configurations.json").exists()


def test_a_sweep_whose_configuration_cannot_be_saved_prints_its_table_and_writes_its_plot(tmp_path, capsys,
                                                                                          monkeypatch):
    """--save-as checked before the sweep, and its file made unreadable while it ran (here a folder where the file
    was to be; a full disk likewise): the error ended the command before the table and the recommendation were
    printed."""
    import app.sweep_plot
    import engine.records.sweep as sweep
    from engine.records import configurations

    saved = tmp_path / "configurations.json"
    monkeypatch.setattr(configurations, "default_path", lambda: saved)
    monkeypatch.setattr(app.sweep_plot, "export_sweep_plot",
                        lambda _points, _budget, path: Path(path).write_text("plot"))
    run_scenario = sweep.run_scenario
    monkeypatch.setattr(sweep, "run_scenario", lambda *args, **kwargs: saved.mkdir(exist_ok=True)
                        or run_scenario(*args, **kwargs))
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                             "--max-new-tokens", "1", "--repeats", "1", "--history", str(tmp_path / "h.sqlite"),
                             "--save-as", "quick", "--plot", str(tmp_path / "sweep.png"))
    assert status == 2 and out.count("<- recommended") == 1 and (tmp_path / "sweep.png").read_text() == "plot"
    last = err.splitlines()[-1]
    assert last == (f"moe-workbench: error: --save-as quick: {saved}: not saved (Is a directory); the sweep completed: "
                    "its points and recommendation are printed and its runs saved in the history")


def test_a_sweep_plot_whose_folder_went_during_the_sweep_says_so(tmp_path, capsys, monkeypatch):
    """The plot's folder, there when the sweep began, removed while it ran: the line said the system's "No such file
    or directory", which reads as the plot file missing."""
    import shutil

    import app.sweep_plot

    folder = tmp_path / "plots"
    folder.mkdir()
    monkeypatch.setattr(app.sweep_plot, "export_sweep_plot",
                        lambda _points, _budget, path: shutil.rmtree(folder) or Path(path).write_bytes(b"plot"))
    status, _out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                              "--max-new-tokens", "1", "--repeats", "1", "--history", str(tmp_path / "h.sqlite"),
                              "--plot", str(folder / "sweep.png"))
    assert status == 2 and err.splitlines()[-1].startswith(
        f"moe-workbench: error: --plot {folder / 'sweep.png'}: not written (its folder does not exist); the sweep "
        "completed")


def test_a_sweep_whose_plot_fails_prints_its_table_and_saves_its_configuration(tmp_path, capsys, monkeypatch):
    """A plot that could not be written after a complete sweep (here a disk that filled) ended the command there:
    neither the table nor the recommendation was printed and --save-as was skipped, though the runs were saved."""
    import app.sweep_plot
    from engine.records import configurations

    def disk_full(_points, _budget, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(configurations, "default_path", lambda: tmp_path / "configurations.json")
    monkeypatch.setattr(app.sweep_plot, "export_sweep_plot", disk_full)
    plot = tmp_path / "sweep.png"
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                             "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"), "--save-as", "quick",
                             "--plot", str(plot))
    assert status == 2 and out.count("<- recommended") == 1 and len(out.splitlines()) == 4
    assert list(json.loads((tmp_path / "configurations.json").read_text())) == ["quick"]
    assert err.splitlines()[-1] == (f"moe-workbench: error: --plot {plot}: not written (No space left on device); "
                                    "the sweep completed: its points and recommendation are printed and its runs "
                                    "saved in the history")


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_a_sweep_plot_qt_could_not_write_is_an_error_not_an_earlier_file_left_as_this_ones(tmp_path, suffix):
    """Qt's writers say a failure only on their own stderr: where the plot's name was a file already that could not
    be written over (here a link to the read-only /proc/version, as a file of another user's), the sweep said nothing
    and exited 0, the file there read as this sweep's plot. (A process of its own: the plot's Qt application, made
    outside pytest-qt's, aborts pytest's process at its exit.)"""
    plot = tmp_path / f"sweep{suffix}"
    plot.symlink_to("/proc/version")
    result = run_cli("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                     "--max-new-tokens", "1", "--repeats", "1", "--history", str(tmp_path / "h.sqlite"), "--plot",
                     str(plot))
    assert result.returncode == 2 and result.stdout.count("<- recommended") == 1
    # the system's reason, as it is for this user: root may open the file, and its write fails
    assert re.fullmatch(f"moe-workbench: error: --plot {re.escape(str(plot))}: not written \\((Permission denied|"
                        "Input/output error)\\); the sweep completed: its points and recommendation are printed and "
                        "its runs saved in the history", result.stderr.splitlines()[-1])


# `sweep ARGS` with the data file of the model folder (argv[1]) cut short as the sweep saves its CUT_AFTER'th point
CUT_SWEEP = """
import os, sys
from pathlib import Path
from app.cli import main
from engine.records.history import History
data, add_all, saved = Path(sys.argv[1]) / "model.onnx.data", History.add_all, []

def add_all_then_cut(history, records, ids):
    add_all(history, records, ids)
    saved.append(records)
    if len(saved) == int(os.environ["CUT_AFTER"]):
        data.write_bytes(data.read_bytes()[:4096])

History.add_all = add_all_then_cut
sys.exit(main(sys.argv[2:]))
"""


def test_a_both_splits_sweep_on_a_data_file_truncated_after_a_whole_layers_point_keeps_its_points(copy_fixture,
                                                                                                   tmp_path):
    """Truncated after a point on whole layers, the data file refused the next point's re-plan, and then the re-plan
    that put the model's own layer split back: that error replaced the point's, and the sweep said it failed "before
    the first point". One that had run every point failed likewise, its recommendation lost. The point's failure is
    said (the process ends: the split needs no putting back), and a sweep that completed is complete."""
    folder = copy_fixture("gptoss")
    data = folder / "model.onnx.data"
    cut = (f"{data}: truncated since the model was loaded: it has 4096 bytes of the {data.stat().st_size} its "
           "initializers take; load the model again")

    def sweep(cut_after: int, *args: str) -> subprocess.CompletedProcess:
        shutil.copyfile(fixture_folder("gptoss") / "model.onnx.data", data)
        return subprocess.run([sys.executable, "-c", CUT_SWEEP, str(folder), "sweep", str(folder), "--device",
                               "simulated", "--points", "3", "--both-splits", "--max-new-tokens", "2", "--repeats",
                               "1", "--history", str(tmp_path / f"h{cut_after}.sqlite"), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "CUT_AFTER": str(cut_after)})

    result = sweep(3)  # 0% spread, 50% spread, 50% whole; then 100% spread
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line.split()[3] for line in result.stdout.splitlines()[2:]] == ["spread", "spread", "whole"]
    assert result.stderr.splitlines()[-1] == (
        "moe-workbench: error: the sweep failed at budget share 100% spread (device_expert_bytes=565248), point 4 of "
        f"4: {cut}; the 3 points before it are printed, their 3 runs saved in the history (ids 1 to 3); no "
        "recommendation")
    result = sweep(4, "--layer-split", "whole")  # every point run, the last spread
    # (which point the timings recommend varies from run to run: that one is, and said, is what a completed sweep has)
    rows = result.stdout.splitlines()[2:]
    assert result.returncode == 0 and len(rows) == 4, result.stderr
    assert [row.endswith("<- recommended") for row in rows].count(True) == 1, result.stdout
    assert result.stderr.splitlines()[-1].startswith("recommended: "), result.stderr


def test_history_lists_labels_and_budgets_shows_runs_by_id_and_says_when_there_are_none(tmp_path, capsys):
    gptoss, history = str(fixture_folder("gptoss")), str(tmp_path / "h.sqlite")
    status, _out, err = _main(capsys, "history", "--history", history)
    assert status == 2 and "h.sqlite: no run history there" in err
    status, out, _err = _main(capsys, "record", gptoss, "--device", "simulated", "--offload",
                              "device_expert_bytes=2097152", "--max-new-tokens", "1", "--label", "tuned",
                              "--history", history, "--json")
    assert status == 0 and json.loads(out)[0]["id"] == 1
    status, out, _err = _main(capsys, "record", gptoss, "--max-new-tokens", "1", "--history", history)
    assert status == 0 and "run 2:" in out and "decode n/a (one token)" in out
    status, out, _err = _main(capsys, "history", "--history", history)
    lines = out.splitlines()
    assert "  tuned  " in lines[1] and "budget 2.0 MiB" in lines[1] and "budget -" in lines[0]
    status, out, _err = _main(capsys, "history", "--history", history, "--label", "TUNED")
    assert status == 0 and len(out.splitlines()) == 1 and out.lstrip().startswith("1 ")
    status, out, _err = _main(capsys, "history", "--history", history, "--json")  # as record's and inspect's --json
    assert status == 0 and [(run["id"], run["label"]) for run in json.loads(out)] == [(2, ""), (1, "tuned")]
    status, out, _err = _main(capsys, "history", "--history", history, "--id", "2")
    assert status == 0 and [run["id"] for run in json.loads(out)] == [2] and out.endswith("]\n")
    # every id checked before any is printed (run 2 was printed, then 9 refused)
    status, out, err = _main(capsys, "history", "--history", history, "--id", "2", "9")
    assert (status, out, err) == (2, "", f"moe-workbench: error: {history}: no run 9\n")
    status, out, err = _main(capsys, "history", "--history", history, "--id", "10", "1", "9", "--export", "csv")
    assert (status, out, err) == (2, "", f"moe-workbench: error: {history}: no runs 9, 10\n")
    status, out, err = _main(capsys, "history", "--history", history, "--scenario", "long")
    assert status == 0 and out == "" and "no runs match in" in err
    status, _out, err = _main(capsys, "history", "--history", history, "--scenario", "bogus")
    assert status == 2 and "--scenario 'bogus': runs are of scenario 'short', 'long'" in err


def test_record_samples_as_asked_seeded_so_that_a_repeat_run_answers_alike_and_says_how_in_the_record(
        tmp_path, capsys):
    """record made every run greedy: a user whose model samples could not record runs as they answer. It samples as
    --temperature, --top-k, --top-p, --repetition-penalty and --seed say (generate's options, onnxruntime-genai's
    search keys), seeded 0 where no --seed is given so that a repeat run samples the same tokens; the record keeps
    the settings, the seed too."""
    gptoss, history = str(fixture_folder("gptoss")), str(tmp_path / "h.sqlite")
    run = ("record", gptoss, "--max-new-tokens", "8", "--history", history, "--json")
    sampled = ("--temperature", "1.5", "--top-k", "40", "--top-p", "0.9")
    status, out, err = _main(capsys, *run, *sampled)
    assert status == 0, err
    first = json.loads(out)[0]
    assert first["generation"] | {"stop_strings": None} == {
        "max_new_tokens": 8, "do_sample": True, "temperature": 1.5, "top_k": 40, "top_p": 0.9,
        "repetition_penalty": 1.0, "seed": 0, "stop_strings": None, "reasoning": None}
    assert "record: sampling: temperature 1.5, top-k 40, top-p 0.9, seed 0" in err
    again = json.loads(_main(capsys, *run, *sampled)[1])[0]
    assert again["turns"][0]["tokens"] == first["turns"][0]["tokens"]  # the same seed, the same answer
    greedy = json.loads(_main(capsys, *run)[1])[0]
    assert greedy["generation"]["do_sample"] is False and greedy["generation"]["seed"] is None
    assert greedy["turns"][0]["tokens"] != first["turns"][0]["tokens"]
    other = json.loads(_main(capsys, *run, *sampled, "--seed", "7")[1])[0]
    assert other["generation"]["seed"] == 7
    status, _out, err = _main(capsys, *run, "--temperature", "1", "--top-p", "1.5")
    assert status == 2 and "top_p" not in err and "--top-p must be in [0, 1], got 1.5" in err


def test_record_and_sweep_sample_as_the_models_genai_config_says_with_model_sampling(copy_fixture, tmp_path, capsys):
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"].update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, num_beams=4)
    (folder / "genai_config.json").write_text(json.dumps(config))
    history = str(tmp_path / "h.sqlite")
    status, out, err = _main(capsys, "record", str(folder), "--max-new-tokens", "4", "--history", history, "--json",
                             "--model-sampling", "--seed", "5")
    assert status == 0, err
    assert {key: json.loads(out)[0]["generation"][key] for key in ("do_sample", "temperature", "top_k", "top_p",
                                                                    "seed")} == {
        "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 5}
    assert "warning: the model's genai_config.json asks for beam search (search.num_beams 4)" in err
    config["search"]["random_seed"] = 9  # the model's seed where --seed gives none, as generate takes it
    (folder / "genai_config.json").write_text(json.dumps(config))
    status, out, err = _main(capsys, "record", str(folder), "--max-new-tokens", "4", "--history", history, "--json",
                             "--model-sampling")
    assert status == 0, err
    assert json.loads(out)[0]["generation"]["seed"] == 9 and "seed 9" in err
    config["search"]["random_seed"] = -1
    (folder / "genai_config.json").write_text(json.dumps(config))
    status, out, err = _main(capsys, "sweep", str(folder), "--device", "simulated", "--points", "2",
                             "--max-new-tokens", "2", "--history", history, "--model-sampling")
    assert status == 0, err
    from engine.records.history import History

    saved = History(history)
    sweep_runs = [saved.get(row["id"]) for row in saved.rows(label="sweep")]
    assert len(sweep_runs) == 2 * 3  # 3 repeats a point
    assert all((r.generation["do_sample"], r.generation["temperature"], r.generation["seed"]) == (True, 0.6, 0)
               for r in sweep_runs)


@pytest.mark.parametrize("error,status,line", [
    (WorkbenchError("the device is out of memory"), 2, "moe-workbench: error: multiturn: the device is out of memory"),
    (KeyboardInterrupt(), 130, "moe-workbench: interrupted during multiturn")])
def test_record_stopped_at_a_later_scenario_says_and_prints_the_runs_it_saved(tmp_path, capsys, monkeypatch, error,
                                                                            status, line):
    """`record --scenario all --json` that failed (or was interrupted) at its second scenario printed no JSON and said
    only the error: the run it had saved was in the history, but neither its output nor its message said so."""
    from engine.records import scenarios

    run_scenario = scenarios.run_scenario

    def fails_at_multiturn(model, name, *args, **kwargs):
        if name == "multiturn":
            raise error
        return run_scenario(model, name, *args, **kwargs)

    monkeypatch.setattr(scenarios, "run_scenario", fails_at_multiturn)
    got, out, err = _main(capsys, "record", str(fixture_folder("gptoss")), "--scenario", "all", "--max-new-tokens",
                          "49", "--history", str(tmp_path / "h.sqlite"), "--json")
    assert got == status and [(run["id"], run["scenario"]) for run in json.loads(out)] == [(1, "short")]
    assert err.splitlines()[-1] == f"{line}; the 1 run before it is saved in the history (id 1)"


def test_record_all_skips_a_scenario_the_context_cannot_hold_and_runs_the_others(tmp_path, capsys):
    """On gptoss's 2,048-token context the long input (2,000 tokens) leaves no room for a 64-token answer: `record
    --scenario all` saved the short run, then stopped in an error before multiturn (exit 2). It skips the long one,
    saying why, as sweep and the window's Record do; asked alone it is still refused."""
    from engine.records.history import History

    gptoss, history = str(fixture_folder("gptoss")), tmp_path / "h.sqlite"
    status, out, err = _main(capsys, "record", gptoss, "--scenario", "all", "--max-new-tokens", "49", "--history",
                             str(history))
    assert status == 0, err
    assert ("record: skipped long: the long-input scenario needs a context of at least 2049 tokens; the model has "
            "2048") in err.splitlines()
    assert [line.split(":")[0] for line in out.splitlines()] == ["short", "multiturn"]
    assert sorted(row["scenario"] for row in History(history).rows()) == ["multiturn", "short"]
    status, _out, err = _main(capsys, "record", gptoss, "--scenario", "long", "--max-new-tokens", "49", "--history",
                              str(history))
    assert status == 2 and err.endswith("error: the long-input scenario needs a context of at least 2049 tokens; the "
                                        "model has 2048\n")


def test_record_names_the_scenario_whose_prompt_the_context_cannot_hold(copy_fixture, tmp_path, capsys):
    """record's first run refused for a prompt past the model's context said "the prompt has N tokens but the model's
    context is M", naming no scenario (with --scenario all, which of the three?); a later run's failure named it."""
    folder = gptoss_with_context(copy_fixture, 24)
    for scenario in ("short", "all"):
        status, _out, err = _main(capsys, "record", str(folder), "--scenario", scenario, "--max-new-tokens", "2",
                                  "--history", str(tmp_path / "h.sqlite"))
        assert status == 2 and re.fullmatch(r"moe-workbench: error: short: the prompt has \d+ tokens but the model's "
                                            r"context is 24", err.splitlines()[-1]), err


def test_records_multiturn_past_the_context_does_not_say_to_start_a_new_conversation(copy_fixture, tmp_path, capsys):
    """A multiturn run whose answers filled the model's context ended in the chat's refusal, "...: start a new
    conversation", which no record can do; it says what leaves the turns more room instead, naming the flag that sets
    it (it said "a smaller answer length", the window's name, where the user types --max-new-tokens)."""
    folder = gptoss_with_context(copy_fixture, 80)
    said = (r"multiturn: the conversation so far \(\d+ tokens\) and this message \(\d+\) come to \d+ tokens, past the "
            r"model's context of 80 \(a smaller --max-new-tokens leaves the scenario's turns more room\)")
    record = ("record", str(folder), "--max-new-tokens", "30", "--history", str(tmp_path / "h.sqlite"))
    status, _out, err = _main(capsys, *record, "--scenario", "multiturn")
    assert status == 2 and re.fullmatch(f"moe-workbench: error: {said}", err.splitlines()[-1]), err
    status, _out, err = _main(capsys, *record, "--scenario", "all")  # after the short run, saved
    assert status == 2 and re.fullmatch(f"moe-workbench: error: {said}; the 1 run before it is saved in the history "
                                        r"\(id \d+\)", err.splitlines()[-1]), err


def test_record_and_sweep_say_that_scenario_all_checks_the_long_inputs_room_and_not_the_multiturns():
    """--scenario's help said "all: the three, where the context holds them", while only the long input is checked
    before the runs: a multiturn's later turns have the room the answers before them leave, and one with none fails
    the run (record, above) or the sweep at its point (below). The help says which is checked, and what a multiturn
    turn without room does."""
    import argparse

    from app.cli import _build_parser

    commands = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    said = {name: next(a.help for a in commands[name]._actions if a.dest == "scenario") for name in ("record", "sweep")}
    checked = ("short: one question; long: a report of about 2,000 tokens, its main points asked for; multiturn: a "
               "chat of six questions; all: the three, the long input left out where the model's sequences cannot hold "
               "it and an answer of --max-new-tokens; a multiturn's turn the answers before it leave no room for "
               "fails ")
    assert said == {"record": checked + "the run; the runs before it are saved (default short)",
                    "sweep": checked + "the sweep at that point; the points before it are kept (default short)"}


def test_a_sweeps_multiturn_past_the_context_does_not_say_to_start_a_new_conversation(copy_fixture, tmp_path,
                                                                                      capsys):
    """As record's (above): a sweep whose multiturn answers filled the model's context failed in the chat's "...:
    start a new conversation", which a sweep cannot do; it says what leaves the turns more room, naming
    --max-new-tokens (not the window's "answer length"), and that the multiturn failed (it named only the point, where
    the point's short warm-up answer had run)."""
    folder = gptoss_with_context(copy_fixture, 80)
    status, _out, err = _main(capsys, "sweep", str(folder), "--device", "simulated", "--points", "2", "--repeats", "1",
                              "--scenario", "multiturn", "--max-new-tokens", "30", "--history",
                              str(tmp_path / "h.sqlite"))
    assert status == 2 and re.fullmatch(
        r"moe-workbench: error: the sweep failed at budget share 0% \(device_expert_bytes=0\), point 1 of 2, in its "
        r"multiturn run: the conversation so far \(\d+ tokens\) and this message \(\d+\) come to \d+ tokens, past "
        r"the model's context of 80 \(a smaller --max-new-tokens leaves the scenario's turns more room\); no point "
        r"finished before it; no recommendation", err.splitlines()[-1]), err


def test_contention_multiturn_past_the_context_does_not_say_to_start_a_new_conversation(copy_fixture, tmp_path,
                                                                                        capsys, monkeypatch):
    """As record's (above): contention's multiturn inference whose answers filled the model's context ended in the
    chat's "...: start a new conversation", which the test cannot do; it says what leaves the turns more room, naming
    --max-new-tokens (not the window's "answer length"). It said so only after the untimed indexing warm-up had
    indexed the whole corpus (minutes on the default one): the inference warms up first now, and no indexing runs
    before the refusal."""
    import engine.records.contention as contention
    from engine.records.contention import make_corpus

    indexed = []
    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: indexed.append(folder) or (2, 0.1))
    folder = gptoss_with_context(copy_fixture, 80)
    corpus = make_corpus(tmp_path / "corpus", files=2, words_per_file=30)
    status, _out, err = _main(capsys, "contention", str(folder), "--corpus", str(corpus), "--workers", "1",
                              "--scenario", "multiturn", "--max-new-tokens", "30")
    assert status == 2 and re.fullmatch(
        r"moe-workbench: error: multiturn: the conversation so far \(\d+ tokens\) and this message \(\d+\) come to "
        r"\d+ tokens, past the model's context of 80 \(a smaller --max-new-tokens leaves the scenario's turns more "
        r"room\)", err.splitlines()[-1]), err
    assert indexed == []


def test_contention_names_the_scenario_whose_prompt_the_context_cannot_hold(copy_fixture, tmp_path, capsys,
                                                                            monkeypatch):
    """contention's inference refused for a prompt past the model's context said "the prompt has N tokens but the
    model's context is M", naming no scenario, where record names it; it names it as record does."""
    import engine.records.contention as contention
    from engine.records.contention import make_corpus

    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: (2, 0.1))
    folder = gptoss_with_context(copy_fixture, 24)
    corpus = make_corpus(tmp_path / "corpus", files=2, words_per_file=30)
    status, _out, err = _main(capsys, "contention", str(folder), "--corpus", str(corpus), "--workers", "1",
                              "--max-new-tokens", "2")
    assert status == 2 and re.fullmatch(r"moe-workbench: error: short: the prompt has \d+ tokens but the model's "
                                        r"context is 24", err.splitlines()[-1]), err


def test_contention_refuses_the_long_input_on_a_short_context_before_any_indexing(tmp_path, capsys, monkeypatch):
    """On gptoss's 2,048-token context the long input leaves no room for 60-token answers: contention refused it only
    at its first inference, after the warm-up had indexed the whole corpus (minutes on the default one). It is refused
    before any indexing, in record's words."""
    import engine.records.contention as contention
    from engine.records.contention import make_corpus

    indexed = []
    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: indexed.append(folder) or (1, 0.1))
    corpus = make_corpus(tmp_path / "corpus", files=2, words_per_file=30)
    status, _out, err = _main(capsys, "contention", str(fixture_folder("gptoss")), "--corpus", str(corpus),
                              "--workers", "1", "--scenario", "long", "--max-new-tokens", "60")
    assert status == 2 and err.splitlines()[-1] == (
        "moe-workbench: error: the long-input scenario needs a context of at least 2060 tokens; the model has 2048")
    assert indexed == []


def test_a_sweep_saved_under_a_layer_split_and_decode_path_keeps_them_for_config(tmp_path, capsys, monkeypatch):
    """A sweep run with --layer-split spread --decode-path cpu saves both beside the entries (a configuration held
    onnxruntime's keys only, so --config ran it with both measured anew, not as swept); --config sets them where
    the command line does not, and a value no choice has is refused naming the file."""
    from engine.records import configurations

    saved_at = tmp_path / "configurations.json"
    monkeypatch.setattr(configurations, "default_path", lambda: saved_at)
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "sweep", gptoss, "--device", "simulated", "--points", "2",
                              "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"), "--save-as", "quick",
                              "--layer-split", "spread", "--decode-path", "cpu", "--simulated-vram", "5000000")
    assert status == 0
    assert (f"saved as configuration 'quick' in {saved_at} (use it with --config quick, which also sets "
            "--layer-split spread --decode-path cpu)") in err
    item = json.loads(saved_at.read_text())["quick"]
    assert item["note"].endswith("; with --layer-split spread --decode-path cpu")
    assert (item["layer_split"], item["decode_path"]) == ("spread", "cpu")

    def generated(*more):
        status, out, err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--max-new-tokens", "2", "--json",
                                 "--device", "simulated", "--config", "quick", *more)
        assert status == 0, err
        state = json.loads(out)["offload"]
        return state["layer_split"]["mode"], state["decode_path"]["mode"]
    assert generated() == ("spread", "cpu")
    assert generated("--layer-split", "whole", "--decode-path", "tier") == ("whole", "tier")
    saved_at.write_text(json.dumps({"quick": dict(item, decode_path="fast")}))
    status, _out, err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--device", "simulated", "--config", "quick")
    assert status != 0 and f"{saved_at}: configuration 'quick': decode_path 'fast' is not one of auto, cpu, tier, both" in err


def test_a_sweeps_saved_configuration_is_what_config_starts_from(tmp_path, capsys, monkeypatch):
    from engine.records import configurations
    from engine.records.history import History

    monkeypatch.setattr(configurations, "default_path", lambda: tmp_path / "configurations.json")
    gptoss = str(fixture_folder("gptoss"))
    # (no --plot in this process: pyqtgraph's widgets made here crash the test process at exit; the plot is
    # checked in a process of its own, test_records.test_cli_record_sweep_history_contention)
    status, out, err = _main(capsys, "sweep", gptoss, "--device", "simulated", "--points", "2", "--max-new-tokens", "2",
                             "--history", str(tmp_path / "h.sqlite"), "--save-as", "quick", "--json", "--margin",
                             "0.025", "--simulated-vram", "5000000")
    assert status == 0
    budget = json.loads(out)["recommended_budget_bytes"]
    assert f"saved as configuration 'quick' in {tmp_path / 'configurations.json'} (use it with --config quick)" in err
    saved = json.loads((tmp_path / "configurations.json").read_text())["quick"]
    assert saved["note"].startswith("sweep recommendation within 2.5% of the fastest") or (  # or tied beyond it
        json.loads(out)["recommended_as_tie"] and saved["note"].startswith("sweep recommendation tied with the fastest"))
    assert History(tmp_path / "h.sqlite").rows()[0]["device"] == "simulated GPU, 4.8 MiB"
    assert saved["model"] == str(fixture_folder("gptoss").resolve())
    status, out, _err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--max-new-tokens", "2", "--json",
                              "--device", "simulated", "--config", "quick")
    assert status == 0
    status, out, _err = _main(capsys, "inspect", gptoss, "--json", "--device", "simulated", "--config", "quick")
    assert json.loads(out)["offload"]["budget_bytes"] == budget
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--config", "slow")
    assert status == 2 and "no saved configuration 'slow'" in err and "(saved: quick)" in err
    lfm2 = str(fixture_folder("lfm2moe"))
    status, _out, err = _main(capsys, "inspect", lfm2, "--device", "simulated", "--config", "quick")
    assert status == 0 and f"warning: configuration 'quick' was saved for {fixture_folder('gptoss').resolve()}" in err
    (tmp_path / "configurations.json").write_text("{broken")
    status, _out, err = _main(capsys, "sweep", gptoss, "--device", "simulated", "--points", "2", "--history",
                              str(tmp_path / "h2.sqlite"), "--save-as", "again")
    assert status == 2 and "configurations.json: not readable as saved configurations" in err
    assert not (tmp_path / "h2.sqlite").exists() or not History(tmp_path / "h2.sqlite").rows()  # refused before it ran


def test_offload_entries_replace_a_saved_configurations_under_any_name_and_must_agree_among_themselves(
        tmp_path, capsys, monkeypatch):
    from engine.offload import OffloadConfig
    from engine.records import configurations

    monkeypatch.setattr(configurations, "default_path", lambda: tmp_path / "configurations.json")
    gptoss = str(fixture_folder("gptoss"))
    configurations.save_configuration("small", fixture_folder("gptoss").resolve(),
                                      OffloadConfig(device_expert_bytes=200_000))
    status, out, _err = _main(capsys, "inspect", gptoss, "--json", "--device", "simulated", "--config", "small",
                              "--offload", "gpu_budget_bytes=400000")
    assert status == 0 and json.loads(out)["offload"]["budget_bytes"] == 400_000
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "device_expert_bytes=1",
                              "--offload", "gpu_budget_bytes=2")
    assert status == 2 and err == ("moe-workbench: error: conflicting values for one setting: device_expert_bytes='1' "
                                   "and gpu_budget_bytes='2'\n")
    # one name given twice: the first value was dropped without a word (onnxruntime, too, keeps one entry a key)
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "device_expert_bytes=1",
                              "--offload", "device_expert_bytes=2")
    assert status == 2 and err == ("moe-workbench: error: conflicting values for one setting: device_expert_bytes='1' "
                                   "and device_expert_bytes='2'\n")
    status, _out, _err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "placement=static",
                               "--offload", "placement=static")
    assert status == 0


def test_inspect_json_gives_the_configuration_to_copy_out_as_session_config_entries(capsys):
    status, out, _err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated",
                              "--offload", "gpu_budget_bytes=400000", "--offload", "mode=1")
    entries = json.loads(out)["offload"]["session_config_entries"]
    assert status == 0 and entries["session.moe.offload.device_expert_bytes"] == "400000"
    assert entries["session.moe.offload.mode"] == "required"  # onnxruntime's mode=1, in its own word
    assert entries["session.moe.offload.prefill_wave_experts"] == "8" and len(entries) == 17  # defaults written out


def test_a_saved_configuration_that_cannot_be_used_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    from engine.records import configurations

    monkeypatch.setattr(configurations, "default_path", lambda: tmp_path / "configurations.json")
    gptoss = str(fixture_folder("gptoss"))
    (tmp_path / "configurations.json").write_text(json.dumps({
        "edited": {"model": gptoss, "entries": {"session.moe.offload.mode": "sometimes"}, "note": ""},
        "broken": ["not", "a", "configuration"]}))
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--config", "edited")
    assert status == 2 and err == (f"moe-workbench: error: {tmp_path / 'configurations.json'}: configuration 'edited': "
                                   "session.moe.offload.mode='sometimes': expected one of disabled, auto, required\n")
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--config", "broken")
    assert status == 2 and err == (f"moe-workbench: error: {tmp_path / 'configurations.json'}: configuration 'broken' "
                                   "is not a model folder and its offload entries\n")
    (tmp_path / "configurations.json").write_text("[]")
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--config", "edited")
    assert status == 2 and err.endswith("not readable as saved configurations (not a JSON object of named ones)\n")


def test_device_budgets_without_a_device_are_said_to_do_nothing(capsys):
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--offload", "device_expert_bytes=4000000",
                              "--offload", "session.moe.offload.placement=static", "--offload", "cpu_threads=1")
    assert status == 0 and ("warning: device_expert_bytes, placement: no effect with --device cpu, where every expert "
                            "runs on the CPU (--device simulated or cuda)") in err


def test_device_budgets_under_mode_disabled_on_the_simulated_gpu_are_said_to_do_nothing(capsys):
    """mode=disabled puts every expert where the dense part runs, the CPU beside the simulated GPU (which takes
    experts only): an expert budget or placement given with it did nothing, and `generate` said nothing of it (its plan,
    which says so, is in --json alone). Approximate routing's keys are said once, by their own warning."""
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                              "mode=disabled", "--offload", "device_expert_bytes=4000000", "--offload",
                              "placement=static", "--offload", "tail_substitution_threshold=0.5", "--offload",
                              "cpu_threads=1")
    assert status == 0 and err == (
        "warning: device_expert_bytes, placement: no effect under mode=disabled on the simulated GPU, which takes "
        "experts only: every expert runs on the CPU, beside the dense part\n"
        "warning: tail_substitution_threshold=0.5: no effect under mode=disabled, which offloads nothing: routing is "
        "exact (approximate routing needs mode=auto or required)\n")
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                              "mode=disabled")
    assert status == 0 and err == ""


def test_tail_substitution_without_a_device_is_said_to_do_nothing(capsys):
    """Tail substitution replaces a cold expert by a resident one: with --device cpu none is resident, so it substituted
    nothing, without a word (min_expert_weight, which drops experts, does apply there)."""
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--offload",
                              "tail_substitution_threshold=0.5", "--offload", "tail_substitution_min_rank=0",
                              "--offload", "min_expert_weight=0.1")
    assert status == 0 and err == ("warning: tail_substitution_min_rank, tail_substitution_threshold: no effect with "
                                   "--device cpu, where every expert runs on the CPU (--device simulated or cuda)\n")


def test_cpu_execution_and_async_max_tokens_without_a_device_are_said_to_do_nothing(capsys):
    """cpu_execution says whether cold experts may run on the CPU or are copied to the device, async_max_tokens up to
    which step the CPU overlaps the device: with --device cpu every expert runs on the CPU and both did nothing,
    without the warning the other device settings give."""
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--offload", "cpu_execution=disabled",
                              "--offload", "async_max_tokens=0", "--offload", "cpu_threads=1")
    assert status == 0 and err == ("warning: async_max_tokens, cpu_execution: no effect with --device cpu, where every "
                                   "expert runs on the CPU (--device simulated or cuda)\n")


def test_offload_keys_this_engine_does_not_use_are_said_to_do_nothing_here(capsys):
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                              "session.moe.offload.skip_zero_cold_doorbell=1", "--offload", "budget_group=shared")
    assert status == 0 and ("warning: budget_group, skip_zero_cold_doorbell: kept for onnxruntime, but this engine does "
                            "not use them (no effect here)") in err


def test_inspects_own_session_entries_given_back_warn_of_nothing(capsys):
    """inspect --json writes every setting out (session_config_entries: defaults too, so that onnxruntime reads them
    as meant); given back as --offload they warned 'skip_zero_cold_doorbell: kept for onnxruntime, but this engine
    does not use it' and, with --device cpu, that eleven device settings at their defaults had no effect."""
    gptoss = str(fixture_folder("gptoss"))
    status, out, _err = _main(capsys, "inspect", gptoss, "--json", "--device", "simulated")
    entries = json.loads(out)["offload"]["session_config_entries"]
    given = [arg for key, value in entries.items() for arg in ("--offload", f"{key}={value}")]
    for device in ("simulated", "cpu"):
        status, out, err = _main(capsys, "inspect", gptoss, "--json", "--device", device, *given)
        assert status == 0 and err == "", device
    status, out, _err = _main(capsys, "inspect", gptoss, "--json", "--device", "simulated", *given)
    assert json.loads(out)["offload"]["session_config_entries"] == entries
    entries["session.moe.offload.placement"] = "static"
    given = [arg for key, value in entries.items() for arg in ("--offload", f"{key}={value}")]
    status, _out, err = _main(capsys, "inspect", gptoss, *given)
    assert err == ("warning: placement: no effect with --device cpu, where every expert runs on the CPU (--device "
                   "simulated or cuda)\n")


def test_this_apps_own_settings_given_as_offload_keys_are_pointed_to_their_options(capsys):
    """A side-by-side B's settings take layer_split= and decode_path= lines beside onnxruntime's keys; copied to
    --offload they were refused as unknown offload keys with the list of onnxruntime's 26 names."""
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "layer_split=whole")
    assert status == 2 and err == ("moe-workbench: error: --offload layer_split=whole: layer_split is this app's own "
                                   "setting, not an onnxruntime key: --layer-split whole\n")
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "decode_path=tier")
    assert status == 2 and err.endswith("decode_path is this app's own setting, not an onnxruntime key: --decode-path "
                                        "tier\n")


def test_an_offload_value_with_spaces_around_it_is_refused_as_onnxruntime_refuses_it(capsys):
    """--offload stripped its value before OffloadConfig read it, so 'mode=auto ' and 'cpu_threads= 4' passed here
    while onnxruntime 1.32, and OffloadConfig itself, refuse them."""
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "mode=auto ")
    assert status == 2 and err == ("moe-workbench: error: session.moe.offload.mode='auto ': expected one of disabled, "
                                   "auto, required (onnxruntime refuses spaces around the value)\n")
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "cpu_threads= 4")
    assert status == 2 and err == ("moe-workbench: error: session.moe.offload.cpu_threads=' 4': expected an integer "
                                   ">= 0, in digits only (onnxruntime refuses spaces around the value)\n")


def test_generate_refuses_what_it_would_ignore_and_warns_of_unused_sampling_flags(capsys):
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--raw", "--system", "Be brief")
    assert status == 2 and "--system needs the chat template, which --raw leaves out" in err
    status, _out, err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--stop", "")
    assert status == 2 and "--stop needs some text" in err
    status, out, err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--max-new-tokens", "2", "--top-k", "5")
    assert status == 0 and "warning: --top-k, --top-p and --seed apply only when sampling" in err
    assert out.endswith("\n")  # the answer's line ends on standard output


def test_generate_says_no_decode_rate_for_a_one_token_answer(capsys):
    """One token is the prefill's: nothing was decoded. generate's closing line said "0.0 tok/s", as if decoding had
    stalled, where the chat and side by side leave the rate out; it leaves it out too."""
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--greedy", "--max-new-tokens", "1")
    time = r"[\d.]+ (?:s|ms|µs)"  # units.duration_text's
    assert status == 0 and re.fullmatch(rf"\[1 token, first after {time}, {time}; length\]\n", err), err
    status, _out, err = _main(capsys, "generate", gptoss, "--prompt", "Hi", "--greedy", "--max-new-tokens", "3")
    assert status == 0 and re.fullmatch(rf"\[3 tokens, first after {time}, \d+\.\d tok/s, {time}; length\]\n", err), err


def test_generates_line_gives_a_fast_answers_times_as_the_window_does(capsys):
    """generate's closing line gave the answer's time to two decimals: a small model's answer of a few milliseconds
    read "0.00 s", then "0.00220 s", and its first token in whole ms ("1 ms" for 0.9 ms), formats of its own where the
    window's chat line gives both as units.duration_text ("900 µs", "2.20 ms"). It gives them so."""
    from types import SimpleNamespace

    from app.cli import _print_result

    def line(total_s: float) -> str:
        timings = SimpleNamespace(generated_tokens=4, time_to_first_token_s=0.0009, decode_tokens_per_s=2500.0,
                                  total_s=total_s)
        result = SimpleNamespace(timings=timings, routing_agreement=None, finish_reason="length",
                                 cut_in_reasoning=False)
        _print_result(result, None, as_json=False)
        return capsys.readouterr().err
    assert line(0.0022) == "[4 tokens, first after 900 µs, 2500.0 tok/s, 2.20 ms; length]\n"
    assert line(12.345) == "[4 tokens, first after 900 µs, 2500.0 tok/s, 12.35 s; length]\n"


def _warm_up_compiling(model) -> float:
    """warm_model as a first run makes it: Numba compiles (its compile event, heard from another thread as the
    warm-up's first calls are made), 12.345 s."""
    import threading

    from numba.core import event as numba_event

    def compile_once():
        with numba_event.trigger_event("numba:compile", data={"dispatcher": None, "args": (), "return_type": None}):
            pass
    thread = threading.Thread(target=compile_once)
    thread.start()
    thread.join()
    return 12.345


def test_generates_kernel_compilation_line_gives_its_time_as_the_window_does(capsys, monkeypatch):
    """The line saying the CPU kernels compiled before the answer gave its time to one decimal ("12.3 s"), a format of
    its own: it gives it as every other time is given (units.duration_text)."""
    import engine.kernel_warmup
    from app.cli import _warm_up

    monkeypatch.setattr(engine.kernel_warmup, "warm_model", _warm_up_compiling)
    assert _warm_up(None, as_json=False) == 12.345
    assert capsys.readouterr().err == ("generate: the CPU kernels compiled in 12.35 s before the answer (once: Numba "
                                       "caches them); not in the answer's times\n")


def test_generate_says_kernels_loaded_from_the_cache_are_loaded_not_compiled(capsys, monkeypatch):
    """On a busy machine loading the kernels from Numba's cache took 1.1-1.9 s, and generate said they compiled."""
    import engine.kernel_warmup
    from app.cli import _warm_up

    monkeypatch.setattr(engine.kernel_warmup, "warm_model", lambda model: 1.5)
    assert _warm_up(None, as_json=False) == 1.5
    assert capsys.readouterr().err == ("generate: the CPU kernels loaded from Numba's cache in 1.50 s before the "
                                       "answer; not in the answer's times\n")


def test_history_refuses_a_file_that_is_not_one(tmp_path, capsys):
    other = tmp_path / "notes.json"
    other.write_text('{"not": "a database"}' * 200)
    status, _out, err = _main(capsys, "history", "--history", str(other))
    assert status == 2 and f"{other}: not a run history" in err
    assert other.read_text().startswith('{"not"')  # left as it was


def test_inspect_checks_the_pinned_ring_and_the_popularity_file_as_a_load_would(capsys):
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload", "pinned_bytes=100")
    assert status == 2 and "pinned_bytes=100 holds no expert" in err
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "simulated", "--offload",
                              "popularity_file=/nonexistent/popularity.json")
    assert status == 2 and "/nonexistent/popularity.json: cannot read the popularity file" in err
    status, _out, err = _main(capsys, "inspect", gptoss, "--offload", "allow_file_backing=0", "--offload",
                              "host_expert_bytes=1000")
    assert status == 2 and "more than host_expert_bytes=1000" in err  # (inspect called such a model runnable)


def test_inspect_says_which_expert_nodes_the_popularity_file_leaves_to_static_placements_opening(capsys, tmp_path):
    from engine.model_folder import ModelFolder

    gptoss = str(fixture_folder("gptoss"))
    experts = [info for info in ModelFolder.open(gptoss).experts if info.spec is not None]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({experts[0].name: [1] * experts[0].spec.num_experts}))
    status, out, _err = _main(capsys, "inspect", gptoss, "--json", "--device", "simulated", "--offload",
                              f"popularity_file={path}", "--offload", "placement=static", "--offload",
                              "device_expert_bytes=200000")
    assert [info.name for info in experts] == ["/model/layers.0/moe/QMoE", "/model/layers.1/moe/QMoE"]
    said = (f"{path} counts 1 of 2 expert nodes ('/model/layers.0/moe/QMoE'); static placement measures the other 1 "
            "over its opening ('/model/layers.1/moe/QMoE').")
    assert status == 0 and said in json.loads(out)["offload"]["statements"]


def test_inspect_says_which_expert_nodes_the_popularity_file_counts_too_few_experts_of(capsys, tmp_path):
    """The load's plan says which nodes a popularity file counts fewer experts of than their slots (static placement's
    opening measures the rest) and which it counts 0 throughout; inspect says it as the load does."""
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice

    gptoss = fixture_folder("gptoss")
    names = ["/model/layers.0/moe/QMoE", "/model/layers.1/moe/QMoE"]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({names[0]: [1] + [0] * 7, names[1]: [0] * 8}))
    entries = [f"popularity_file={path}", "placement=static", "device_expert_bytes=200000"]
    status, out, _err = _main(capsys, "inspect", str(gptoss), "--json", "--device", "simulated",
                              *[arg for entry in entries for arg in ("--offload", entry)])
    said = (f"{path} counts 1 of 2 expert nodes ('{names[0]}'); static placement measures the other 1 over its opening "
            f"(0 for every expert: '{names[1]}'). {path} counts fewer experts than the layer has slots in 1 expert "
            f"node ('{names[0]}'): static placement places the counted ones at once and fills the slots left with the "
            "experts its opening measures routed most.")
    assert status == 0 and said in json.loads(out)["offload"]["statements"]
    config = OffloadConfig.from_entries({f"session.moe.offload.{entry.split('=')[0]}": entry.split("=")[1]
                                         for entry in entries})
    model = LoadedModel.open(gptoss, offload=config, device=SimulatedDevice(1 << 30))
    assert said in model.offload.plan.statements


@pytest.mark.parametrize("decode_path", ["cpu", "tier"])
def test_inspect_says_what_the_loads_plan_says_the_staging_ring_and_streaming_slots_included(capsys, decode_path):
    """inspect gave the planner's sentences alone: not the prefill wave and pinned ring that pinned_bytes sets, nor the
    streaming slots that device_working_bytes asks for, which the load's plan says (under decode path 'tier': that
    none is made)."""
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice

    gptoss = str(fixture_folder("gptoss"))
    entries = {"device_expert_bytes": "0", "device_working_bytes": "100000000", "pinned_bytes": "80000"}
    status, out, _err = _main(capsys, "inspect", gptoss, "--json", "--device", "simulated", "--decode-path",
                              decode_path,
                              *[arg for key, value in entries.items() for arg in ("--offload", f"{key}={value}")])
    said = json.loads(out)["offload"]["statements"]
    model = LoadedModel.open(gptoss, offload=OffloadConfig.from_entries(entries), device=SimulatedDevice(8 << 30),
                             decode_path=decode_path)
    assert status == 0 and said == model.offload.plan.statements
    assert "Copies to the device go through a pinned staging ring of 78.1 KiB (2 experts)." in said
    on_cpu = "Where decode computes cold experts on the CPU (not from a host tier), the misses of 2 layers without"
    assert any(sentence.startswith(on_cpu) for sentence in said) is (decode_path == "cpu")
    assert any(sentence.startswith("device_working_bytes=100000000 makes no decode streaming slots: under decode path "
                                  "'tier'") for sentence in said) is (decode_path == "tier")


def test_with_every_expert_resident_no_prefill_wave_is_said_to_stream(capsys):
    """The plan said "Cold experts used by many prompt tokens stream to the device in waves of N" where no expert is
    cold; it says so only where the plan leaves some cold, in the load's plan and in inspect alike."""
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice

    gptoss = str(fixture_folder("gptoss"))
    for budget, cold in (("auto", False), ("0", True)):
        status, out, _err = _main(capsys, "inspect", gptoss, "--json", "--device", "simulated",
                                  "--offload", f"device_expert_bytes={budget}")
        said = json.loads(out)["offload"]["statements"]
        model = LoadedModel.open(gptoss, offload=OffloadConfig.from_entries({"device_expert_bytes": budget}),
                                 device=SimulatedDevice(8 << 30))
        assert status == 0 and said == model.offload.plan.statements
        assert (model.offload.plan.placement_mode != "all_resident") is cold
        assert any("stream to the device in waves of" in sentence for sentence in said) is cold, said
        assert any("pinned staging ring" in sentence for sentence in said)


def test_the_window_without_a_display_says_so_in_one_line():
    from app.gui.main import display_problem

    assert "no display to open the window on" in display_problem({}, "linux")
    assert display_problem({"DISPLAY": ":0"}, "linux", loadable=lambda library: True,
                           reachable=lambda display: True) is None
    assert display_problem({"WAYLAND_DISPLAY": "w"}, "linux") is None
    assert display_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux") is None and display_problem({}, "win32") is None


def test_an_x_display_without_the_libraries_qts_xcb_plugin_needs_is_said_in_one_line():
    """Qt aborts the process there (SIGABRT) with a hint that reinstalling may help; the window says which
    libraries are missing and the Debian packages that bring them."""
    from app.gui.main import display_problem

    present = {"libxcb-cursor.so.0", "libxcb-image.so.0", "libxcb-render-util.so.0", "libxcb-shape.so.0",
               "libxcb-xkb.so.1"}
    for env in ({"DISPLAY": ":0"}, {"QT_QPA_PLATFORM": "xcb", "DISPLAY": ":0"}):
        problem = display_problem(env, "linux", loadable=present.__contains__)
        assert problem.startswith("the window needs X libraries that are not installed: libxcb-icccm.so.4, "
                                  "libxcb-keysyms.so.1, libxkbcommon-x11.so.0 (Debian, Ubuntu: apt install "
                                  "libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0); "), problem
        assert "\n" not in problem
    assert display_problem({"QT_QPA_PLATFORM": "xcb"}, "linux", loadable=lambda library: True).startswith(
        "QT_QPA_PLATFORM=xcb asks for an X display and DISPLAY is not set; the commands inspect")
    # Wayland, and a platform chosen that is not xcb, do not load them
    assert display_problem({"DISPLAY": ":0", "WAYLAND_DISPLAY": "w"}, "linux", loadable=present.__contains__) is None
    assert display_problem({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux",
                           loadable=present.__contains__) is None


def test_the_libraries_qt_links_that_are_missing_are_said_in_one_line_with_their_packages():
    """Qt's GUI module links libEGL, libGL, fontconfig, … which PySide6's wheel does not bring: on a slim container the
    window's import failed, said as "internal error: libEGL.so.1: cannot open shared object file", the first alone and
    no package (the X libraries' check is for the xcb platform alone, and passed there)."""
    from app.gui.main import QT_LIBRARIES, qt_library_problem

    present = set(QT_LIBRARIES) - {"libEGL.so.1", "libglib-2.0.so.0", "libgthread-2.0.so.0"}
    problem = qt_library_problem("linux", loadable=present.__contains__)
    assert problem.startswith("the window needs libraries Qt links that are not installed: libEGL.so.1, "
                              "libglib-2.0.so.0, libgthread-2.0.so.0 (Debian, Ubuntu: apt install libegl1 "
                              "libglib2.0-0); the commands inspect, generate, record, sweep and contention work "
                              "without one"), problem
    assert qt_library_problem("linux", loadable=QT_LIBRARIES.__contains__) is None
    assert qt_library_problem("win32", loadable=present.__contains__) is None
    assert qt_library_problem() is None  # this machine runs the suite's window tests: it has them all


def test_an_x_display_no_server_answers_at_is_said_in_one_line():
    """A DISPLAY left from an earlier session (tmux, ssh): Qt aborts there too, advising a reinstall."""
    import pytest

    from app.gui.main import _loadable, display_problem, x_display_reachable

    if not _loadable("libxcb.so.1"):
        pytest.skip("no libxcb here")
    assert not x_display_reachable(":4177")  # no X server at display 4177
    problem = display_problem({"DISPLAY": ":4177"}, "linux", loadable=lambda library: True)
    assert problem.startswith("cannot connect to the X display ':4177' that DISPLAY names (no X server answers "
                              "there, or this user may not use it); the commands inspect, generate"), problem


def test_the_window_without_the_x_libraries_exits_in_one_line_rather_than_aborting():
    import pytest

    from app.gui.main import XCB_LIBRARIES, _loadable

    if not sys.platform.startswith("linux") or all(map(_loadable, XCB_LIBRARIES)):
        pytest.skip("not Linux, or a machine with every library Qt's xcb plugin needs")
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    result = subprocess.run([sys.executable, "-m", "app"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**env, "DISPLAY": ":99"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("moe-workbench: error: the window needs X libraries") and \
        result.stderr.count("\n") == 1, result.stderr


def test_chat_answers_end_their_lines_on_standard_output():
    result = subprocess.run([sys.executable, "-m", "app", "generate", str(fixture_folder("gptoss")), "--prompt", "Hi",
                             "--chat", "--max-new-tokens", "3"], cwd=REPO, capture_output=True, text=True,
                            input="More\nAgain\n", timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) >= 3 and result.stdout.endswith("\n")


def test_errors_name_the_options_the_user_typed(tmp_path, capsys):
    status, _out, err = _main(capsys, "write-model", str(tmp_path / "m"), "--top-k", "9", "--experts", "8")
    assert status == 2 and err.strip() == "moe-workbench: error: --top-k (9) must be <= --experts (8)"
    status, _out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "Hi",
                              "--repetition-penalty", "0")
    assert status == 2 and "--repetition-penalty must be a number > 0" in err


def test_generate_samples_as_the_models_genai_config_says_unless_told(copy_fixture, capsys):
    """Without --greedy or --temperature the model's own defaults apply (genai_config.json's search, as
    onnxruntime-genai reads it): said on standard error; the options given replace them one by one."""
    folder = copy_fixture("qwen35moe")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"].update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    (folder / "genai_config.json").write_text(json.dumps(config))
    run = ("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "6", "--json")
    status, out, err = _main(capsys, *run, "--seed", "3")
    assert status == 0 and "sampling as the model's genai_config.json says: temperature 0.6, top-k 20, top-p 0.95 " \
                           "(--greedy for greedy answers)" in err
    tokens = json.loads(out)["tokens"]
    assert json.loads(_main(capsys, *run, "--seed", "3")[1])["tokens"] == tokens  # its seed repeats it
    status, _out, err = _main(capsys, *run, "--top-k", "1", "--seed", "3")
    assert status == 0 and "says: temperature 0.6, top-k 1, top-p 0.95 (" in err  # what is given replaces its own
    status, greedy_out, err = _main(capsys, *run, "--greedy")
    assert status == 0 and "sampling as" not in err
    assert json.loads(greedy_out)["tokens"] == json.loads(_main(capsys, *run, "--temperature", "0")[1])["tokens"]
    config["search"]["temperature"] = -1.0
    (folder / "genai_config.json").write_text(json.dumps(config))
    status, _out, err = _main(capsys, *run)
    assert status == 2 and "genai_config.json: search: temperature must be a number >= 0, got -1.0" in err


def test_without_onnxruntime_it_says_which_extra_installs_it():
    # a plain `pip install .` has no onnxruntime (only the extras name one): this was an "internal error"
    code = ("import sys; sys.modules['onnxruntime'] = None; from app.cli import main; "
            f"sys.exit(main(['inspect', {str(fixture_folder('qwen35moe'))!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("moe-workbench: error: onnxruntime is not installed: install moe-workbench "
                                    "with the extra for this machine, pip install '.[cpu]'")


def test_an_onnxruntime_left_broken_says_so_and_how_to_mend_it():
    """Two builds installed together and one removed take the files they share (README): onnxruntime's folder without
    its __init__ imports as a namespace package, or its compiled module is gone. Both read "internal error: TypeError:
    expected str, bytes or os.PathLike object, not NoneType" or "… ModuleNotFoundError: No module named …"."""
    namespace = "import types; m = types.ModuleType('onnxruntime'); m.__path__ = []; sys.modules['onnxruntime'] = m"
    no_binary = "sys.modules['onnxruntime.capi.onnxruntime_pybind11_state'] = None"
    for left in (namespace, no_binary):
        code = (f"import sys; {left}; from app.cli import main; "
                f"sys.exit(main(['inspect', {str(fixture_folder('gptoss'))!r}]))")
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("moe-workbench: error: onnxruntime is installed but broken ("), result.stderr
        assert result.stderr.rstrip().endswith("uninstall onnxruntime and onnxruntime-gpu both, then install one (in a "
                                               "checkout, make clean install installs the one this machine needs)")


def test_generate_json_help_names_the_keys_an_answer_has(capsys):
    """`generate --help` says what `--json` prints: every key of the object (it named four of them)."""
    import pytest

    with pytest.raises(SystemExit):
        _main(capsys, "generate", "--help")
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("--json"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("-")), len(lines))
    json_help = " ".join(" ".join(lines[start:end]).split())
    for key in ("prompt_tokens", "tokens", "text", "reasoning", "finish_reason", "timings", "dense", "offload"):
        assert key in json_help


def test_the_layer_splits_help_says_the_trials_run_only_without_a_host_tier(capsys):
    """--layer-split auto "measures both while decoding and keeps the faster", the window's tooltip the same, where the
    engine measures them only without a host tier, which decode path auto (the default) makes on a GPU."""
    from app.gui.budget_panel import SPLIT_TIP

    with pytest.raises(SystemExit):
        _main(capsys, "inspect", "--help")
    split_help = " ".join(capsys.readouterr().out.split("--layer-split {auto,spread,whole}")[2].split())
    assert "without a host tier (decode path cpu, or auto where none is made)" in split_help.split("--decode-path")[0]
    assert "without a host tier (decode path cpu, or auto where none is made)" in SPLIT_TIP


def test_every_commands_help_says_what_each_of_its_arguments_is(capsys):
    """--help listed record's --scenario and --label, sweep's and contention's --scenario and --json, every command's
    model and most of write-model's options with nothing beside them."""
    import argparse

    import pytest

    from app.cli import _build_parser

    commands = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    unsaid = {name: [action.dest for action in command._actions if not action.help] for name, command in
              commands.items()}
    assert unsaid == dict.fromkeys(commands, [])
    for name in commands:  # each --help prints (a stray % in a help text fails only there)
        with pytest.raises(SystemExit):
            _main(capsys, name, "--help")
        assert capsys.readouterr().out.startswith(f"usage: moe-workbench {name}")


def test_the_sweep_table_says_each_points_decode_path(tmp_path, capsys):
    """Each point's row says the decode path its answers ran on (under auto, what the trials kept once they ended:
    engine/records/sweep.py settle): asked for the tier, every point with cold experts reads them from the simulated
    card's host tier, and with every expert resident none is read: the row said "cpu" there, which reads as decoding on
    the CPU, and says "all resident"."""
    status, out, _err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                              "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"), "--decode-path", "tier")
    assert status == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.strip().startswith("budget"))
    assert _columns(header)[:4] == ["budget bytes", "budget share", "resident share", "path"]
    paths = {_columns(line)[2]: _columns(line)[3] for line in lines[lines.index(header) + 1:]}
    assert paths == {"0%": "tier", "50%": "tier", "100%": "all resident"}


def test_the_sweep_json_says_all_resident_where_the_table_does(tmp_path, capsys):
    """With every expert resident no expert is cold and no decode path runs: the table says "all resident", and the
    JSON rows said "cpu" (the path in force), which a script reads as decoding on the CPU."""
    status, out, _err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                              "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"), "--decode-path", "tier",
                              "--json")
    assert status == 0
    assert [(p["fraction"], p["decode_path"]) for p in json.loads(out)["points"]] == [(0.0, "tier"),
                                                                                    (1.0, "all resident")]


def test_the_sweep_json_names_each_points_runs_in_the_history(tmp_path, capsys):
    """A point's runs are saved with the label "sweep 50%", which two sweeps of one model share: the JSON gave no way
    to find the records behind a row. Each row gives its runs' history ids, and its numbers are theirs."""
    from engine.records.history import History

    history = tmp_path / "h.sqlite"
    status, out, _err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                              "--max-new-tokens", "2", "--history", str(history), "--json")
    assert status == 0
    points = json.loads(out)["points"]
    assert [p["record_ids"] for p in points] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # each point's 3 repeats
    for point in points:
        records = [History(history).get(run_id) for run_id in point["record_ids"]]
        assert [r.label for r in records] == [f"sweep budget share {point['fraction']:.0%}"] * 3
        assert point["peak_device_bytes"] == max(r.peaks["device_bytes"] for r in records)
        assert point["repeat_completion_s"] == [r.timings["completion_s"] for r in records]
        assert point["completion_s"] == statistics.median(point["repeat_completion_s"])


def test_a_sweeps_table_ends_with_the_rule_its_recommendation_followed(tmp_path, capsys):
    """The table marked a row "<- recommended" without saying why: not the fastest, its completion rounded to 0.04s
    beside others' 0.04s and 0.05s, the margin nowhere. A line under it says which budget, by which time, within which
    margin of which fastest point, the times as the table gives them (on standard error: the rows stay the table)."""
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                             "--max-new-tokens", "2", "--margin", "0.25", "--history", str(tmp_path / "h.sqlite"))
    assert status == 0
    marked = next(line for line in out.splitlines() if line.endswith("<- recommended"))
    rule = err.splitlines()[-1]
    peak = re.escape(_columns(marked)[8])  # the row's device peak (after the projected decode rate)
    prefix = (rf"recommended: {_columns(marked)[0]} bytes \(budget share {_columns(marked)[1]}\), the least device "
              rf"peak \({peak}\) of the points whose projected completion time is within 25% of the fastest or "
              r"ties with it: ")
    time = r"[\d.]+ (?:s|ms|µs)"  # units.duration_text's
    spreads = (rf"they differ by less than their spreads between repeats \(±{time} and ±{time}\), and it "
               r"holds (less on the device \(device peak [\d.]+ \w?i?B against [\d.]+ \w?i?B\)|as much on the device "
               r"\([\d.]+ \w?i?B\) on a smaller budget)")
    passed = r"(; smaller budgets among them hold more on the device \(.*\))?"
    assert re.fullmatch(rf"{prefix}(itself the fastest \({time}\)|{time}, (within 25% of|tied with) the "
                        rf"fastest \({time}, at budget share \d+%\)((; a tie)?: {spreads})?){passed}; each "
                        r"time the median of 3 repeats", rule), rule
    if "itself the fastest" not in rule:
        best, fastest = (_seconds(text) for text in re.search(rf": ({time}), .*\(({time}),", rule).groups())
        # (three figures each: within 1% of what was compared)
        assert fastest <= best and (best <= fastest * 1.25 * 1.01 or "tied with" in rule)


def _seconds(text: str) -> float:
    """units.duration_text's "2.20 ms" as seconds."""
    value, unit = text.split()
    return float(value) * {"s": 1, "ms": 1e-3, "µs": 1e-6}[unit]


def _columns(row: str) -> list[str]:
    """A table row's cells: they are two spaces apart or more ("552.0 KiB", "all resident" are one cell)."""
    return re.split(r"\s{2,}", row.strip())


def test_the_sweep_table_shows_device_peaks_in_the_unit_that_tells_them_apart(tmp_path, capsys):
    """The table wrote every peak in whole MiB: on gptoss's fixture the device peaks of 0%, 50% and 100% resident (the
    staging ring, then it and half, then all of 552 KiB of experts) all read "1 MiB". They are written in the unit that
    fits, as the window's summary writes them; the budget's heading says its unit, bytes."""
    status, out, _err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "3",
                              "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"))
    assert status == 0
    rows = [line for line in out.splitlines()[2:]]
    assert [_columns(row)[8] for row in rows] == ["552.0 KiB", "828.0 KiB", "1.1 MiB"]
    assert all(_columns(row)[9].endswith(" MiB") for row in rows)  # the RSS peak, hundreds of MiB
    # the budget beside them is device_expert_bytes as set, in bytes: its heading said "budget" alone
    header = _columns(out.splitlines()[1])
    assert header[0] == "budget bytes" and [_columns(row)[0] for row in rows] == ["0", "282624", "565248"]


def test_a_sweeps_table_and_records_line_give_a_small_models_times_as_the_window_does(tmp_path, capsys):
    """On the fixtures every completion in the sweep's table read "0.00s" (measured and projected: 2-9 ms), and
    record's line "completion 0.00 s": nothing to compare budgets by. Then they read "0.00220s" and record's load
    "0.02 s", formats of their own where the window gives every time as units.duration_text ("2.20 ms"): the table,
    record's line and history's give them so."""
    from engine.records.history import History

    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2", "--max-new-tokens", "2",
            "--repeats", "1", "--history", str(tmp_path / "h.sqlite"))
    status, out, _err = _main(capsys, *args)
    assert status == 0
    # the projected cells' headings say which measured column each projects (both read "projected")
    assert _columns(out.splitlines()[1])[4:8] == ["completion", "projected completion", "decode tok/s",
                                                  "projected tok/s"]
    rows = [_columns(line) for line in out.splitlines()[2:]]
    records = [History(tmp_path / "h.sqlite").get(run_id) for run_id in (1, 2)]  # a point's one run: its times
    assert [(row[4], row[5]) for row in rows] == [
        (duration_text(r.timings["completion_s"]), duration_text(r.timings["projected"]["completion_s"]))
        for r in records]
    assert all(re.fullmatch(r"[\d.]+ (ms|µs)", cell) for row in rows for cell in row[4:6]), rows
    status, out, err = _main(capsys, "record", str(fixture_folder("gptoss")), "--max-new-tokens", "2", "--history",
                             str(tmp_path / "h.sqlite"))
    t = History(tmp_path / "h.sqlite").get(3).timings
    assert (f"load {duration_text(t['load_s'])}, first token {duration_text(t['time_to_first_token_s'])}, decode "
            in out and f", completion {duration_text(t['completion_s'])}, peak RSS " in out), out


def test_a_sweeps_device_peaks_say_what_the_device_held_at_each_point(tmp_path, capsys):
    """With the host tier (here asked for; decode path auto makes it too), the 0% point's device peak read 32.5 MiB and
    the 100% point's 1.1 MiB, with nothing to say why a budget of none held more: at 0% the tier maps each slot array's
    device rows rounded up to the 2 MiB granule, a granule even with no slot (as a card's mappings take), and with
    every expert resident no tier is made. Each point says what the device held, by part, and its parts add up to its
    peak (JSON: device_parts; the table: a line under it)."""
    from kernels.gpu.host_tier import TIER_GRANULE

    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2", "--max-new-tokens", "2",
            "--repeats", "1", "--history", str(tmp_path / "h.sqlite"), "--decode-path", "tier")
    status, out, _err = _main(capsys, *args, "--json")
    assert status == 0
    none, every = json.loads(out)["points"]
    ring = none["device_parts"]["prefill staging ring"]
    assert none["device_parts"] == {"host tier mappings": none["peak_device_bytes"] - ring,
                                    "prefill staging ring": ring}
    assert none["device_parts"]["host tier mappings"] % TIER_GRANULE == 0
    assert every["device_parts"] == {"expert slots": every["budget_bytes"], "prefill staging ring": ring}
    assert every["peak_device_bytes"] == every["budget_bytes"] + ring
    status, _out, err = _main(capsys, *args)
    assert status == 0 and (
        f"sweep: device peak by part: budget share 0%: host tier mappings "
        f"{human_bytes(none['peak_device_bytes'] - ring)} + prefill staging ring {human_bytes(ring)}; budget share "
        f"100%: expert slots {human_bytes(every['budget_bytes'])} + prefill staging ring {human_bytes(ring)} (the host "
        "tier maps each slot array's device rows rounded up to the 2.0 MiB mapping granule, a granule even with no "
        "slot; with every expert resident none is mapped)") in err.splitlines()


def test_a_sweep_says_which_layer_split_each_point_ran_on(tmp_path, capsys):
    """On whole layers a budget holds only the layers it fills whole: on a 1 MiB card the engine's trial kept whole
    layers at 50%, 75% and 86%, each holding layer 0's 8 experts (276 KiB), while the table said "75% resident" and
    nothing said the split; without --both-splits no row says it. Each point where the split matters gives the split
    it ran on (JSON: layer_split_run; the device line names it). Here fixed by --layer-split whole."""
    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "5", "--max-new-tokens", "2",
            "--repeats", "1", "--history", str(tmp_path / "h.sqlite"), "--layer-split", "whole", "--decode-path", "cpu")
    status, out, _err = _main(capsys, *args, "--json")
    assert status == 0
    points = json.loads(out)["points"]
    assert [(p["fraction"], p["layer_split_run"]) for p in points] == [
        (0.0, None), (0.25, None), (0.5, "whole"), (0.75, "whole"), (1.0, None)]
    assert [p["device_parts"].get("expert slots") for p in points] == [None, None, 282624, 282624, 565248]
    status, _out, err = _main(capsys, *args)
    assert status == 0 and "; budget share 75% whole: expert slots 276.0 KiB + prefill staging ring" in err


def test_a_sweeps_layer_split_run_is_the_spread_where_the_host_tier_runs_no_trial_and_the_readme_says_so(tmp_path,
                                                                                                        capsys):
    """The README said a point's layer_split_run is the split "which the engine's trial keeps unless --layer-split
    fixes it", where no trial runs at all with the plan's host tier (as its layer split section says): the points ran
    on the spread, which no trial chose. It says the spread is what runs where no trial does."""
    status, out, _err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "5",
                              "--max-new-tokens", "2", "--repeats", "1", "--history", str(tmp_path / "h.sqlite"),
                              "--layer-split", "auto", "--decode-path", "tier", "--json")
    assert status == 0
    points = json.loads(out)["points"]
    assert [(p["fraction"], p["layer_split_run"], p["settle_steps"]) for p in points] == [
        (0.0, None, 0), (0.25, None, 0), (0.5, "spread", 0), (0.75, "spread", 0), (1.0, None, 0)]
    assert all("host tier mappings" in p["device_parts"] for p in points[:4])
    readme = (REPO / "README.md").read_text()
    assert ("`layer_split_run`, the layer split the point ran on where its budget holds some but not all layers whole "
            "(on whole layers the budget past the layers it fills is not used), else null: the one `--layer-split` "
            "fixes, else the one the engine's trial keeps, or the spread where no trial runs (where the plan makes a "
            "host tier, and the other cases the layer split's section above names);") in readme


def test_a_sweeps_resident_column_gives_the_share_of_experts_resident_not_the_budgets(tmp_path, capsys):
    """The "resident" column gave the budget's share of every expert's bytes: on whole layers a budget holds only the
    layers it fills whole (at 25% none, at 75% one of two), and spread over the layers each takes the whole experts
    that fit (at 67% of two 8-expert layers, 5 each). It gives the share of the experts resident as the point's runs
    ended, beside the budget's share, headed "resident share" as the JSON's resident_share is named beside fraction
    (the heading said "resident" alone, which does not say it is a share)."""
    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--max-new-tokens", "2", "--repeats", "1",
            "--history", str(tmp_path / "h.sqlite"))
    status, out, _err = _main(capsys, *args, "--points", "5", "--layer-split", "whole", "--decode-path", "cpu")
    assert status == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.strip().startswith("budget"))
    assert _columns(header)[:3] == ["budget bytes", "budget share", "resident share"]
    assert [tuple(_columns(line)[1:3]) for line in lines[lines.index(header) + 1:]] == [
        ("0%", "0%"), ("25%", "0%"), ("50%", "50%"), ("75%", "50%"), ("100%", "100%")]
    # (the host tier's path: no slot left to copied misses, which hold an expert only once a miss is copied)
    status, out, _err = _main(capsys, *args, "--points", "4", "--layer-split", "spread", "--decode-path", "tier",
                              "--json")
    assert status == 0
    assert [(round(p["fraction"], 3), p["resident_share"]) for p in json.loads(out)["points"]] == [
        (0.0, 0.0), (0.333, 5 / 16), (0.667, 10 / 16), (1.0, 1.0)]


def test_a_sweeps_resident_column_leaves_out_the_slots_left_to_copied_misses_and_says_them(tmp_path, capsys,
                                                                                            monkeypatch):
    """On the CPU path adaptive placement leaves slots to copied misses; "resident" counted whatever miss was copied
    into them last, so it moved with the miss policy's timings from row to row. It counts the residents placement
    keeps (as the landed statement does), and a line under the table, and copy_slot_share in the JSON, say the slots
    left to copies. (The miss policy's cost model leaves one slot a layer here.)"""
    import engine.offload.engine as offload_engine

    monkeypatch.setattr(offload_engine, "miss_slots", lambda *args, **kwargs: 1)
    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--max-new-tokens", "2", "--repeats", "1",
            "--points", "3", "--layer-split", "spread", "--decode-path", "cpu", "--history", str(tmp_path / "h.sqlite"))
    status, out, err = _main(capsys, *args, "--json")
    assert status == 0
    assert [(p["fraction"], p["resident_share"], p["copy_slot_share"]) for p in json.loads(out)["points"]] == [
        (0.0, 0.0, 0.0), (0.5, 6 / 16, 2 / 16), (1.0, 1.0, 0.0)]
    status, out, err = _main(capsys, *args)
    assert status == 0 and [tuple(_columns(line)[1:3]) for line in out.splitlines()[2:]] == [
        ("0%", "0%"), ("50%", "38%"), ("100%", "100%")]
    assert ("sweep: slots left to copied misses, as a share of the experts (not counted as resident: they hold "
            "whichever misses were copied last): budget share 50% spread: 12%\n") in err


def test_a_sweep_of_one_token_answers_shows_no_decode_rate(tmp_path, capsys):
    """With --max-new-tokens 1 no answer decodes past its first token: the table read "0.0" tok/s (and projected
    "0.0") as if decoding had stalled, where record says n/a."""
    status, out, _err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                              "--max-new-tokens", "1", "--history", str(tmp_path / "h.sqlite"))
    assert status == 0
    rows = out.splitlines()[2:]
    assert len(rows) == 2 and all(_columns(row)[6:8] == ["n/a", "n/a"] for row in rows)
    # the JSON rows gave 0.0 (measured and projected) where the table says n/a and each record's rate is null
    status, out, _err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                              "--max-new-tokens", "1", "--repeats", "1", "--history", str(tmp_path / "h.sqlite"),
                              "--json")
    assert status == 0
    assert [(p["decode_tokens_per_s"], p["projected_decode_tokens_per_s"]) for p in json.loads(out)["points"]] == [
        (None, None), (None, None)]


def test_a_sweep_under_mode_required_on_a_small_card_ends_at_what_the_card_holds(tmp_path, capsys):
    """The other modes hold what the device has free where a point asks more (the planner's clamp); mode=required
    refuses such a budget, so a sweep on a card smaller than the experts failed at its first such point. It ends there,
    at what the card holds, and says which points it left out."""
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated",
                             "--simulated-vram", str(1 << 20), "--offload", "mode=required", "--offload", "device_expert_bytes=70656",
                             "--points", "9",
                             "--max-new-tokens", "2", "--history", str(tmp_path / "h.sqlite"), "--json")
    assert status == 0, err
    # 565,248 bytes of experts; the 1 MiB card holds 483,328 beside its staging ring (86%), less than 7/8's 494,592
    assert [(p["budget_bytes"], round(p["fraction"], 3)) for p in json.loads(out)["points"]][-2:] == [
        (423936, 0.75), (483328, 0.855)]
    assert ("sweep: offload mode 'required' refuses a budget above the 472.0 KiB of experts the device holds (budget "
            "share 86%): the sweep ends there, in place of the point at budget share 88%, and leaves out the point at "
            "budget share 100%") in err


def test_a_sweep_skips_a_scenario_its_context_cannot_hold_before_its_first_point(tmp_path, capsys):
    """The long input needs 2,000 tokens and the answer beside it: on gptoss's 2,048-token context with 60-token
    answers `--scenario all` refused it only at the first point, after the warm-up and the point's short run. It is
    skipped before the sweep starts, as the window's Record skips it, and said in one line; asked alone it is refused
    in one line, before any run."""
    from engine.records.history import History

    gptoss, history = str(fixture_folder("gptoss")), tmp_path / "h.sqlite"
    common = ("--device", "simulated", "--points", "2", "--max-new-tokens", "60", "--history", str(history))
    status, _out, err = _main(capsys, "sweep", gptoss, "--scenario", "long", *common)
    assert status == 2 and err.strip().splitlines() == [
        "moe-workbench: error: the long-input scenario needs a context of at least 2060 tokens; the model has 2048"]
    assert History(history).rows() == []
    status, _out, err = _main(capsys, "sweep", gptoss, "--scenario", "all", *common)
    assert status == 0, err
    assert err.splitlines()[0] == ("sweep: skipped long: the long-input scenario needs a context of at least 2060 "
                                   "tokens; the model has 2048")
    assert sorted(row["scenario"] for row in History(history).rows()) == ["multiturn"] * 6 + ["short"] * 6  # 3 repeats


def test_inspect_on_a_cuda_gpu_that_cannot_be_used_plans_for_the_cpu_as_the_window_loads(capsys, monkeypatch):
    """Without CuPy (or a GPU) the window loads with every expert on the CPU and says why; inspect --device cuda
    refused instead (status 2), so a user could not see what the window would run. It now plans for the CPU with the
    window's one-line note, and refuses only under mode=required, as the window does. The note, a sentence that starts
    lines of the window and of a contention report, read "warning: The CUDA GPU ... instead." after the warning's
    colon, unlike every other warning: lower case, without a full stop there."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # (import cupy fails, as on a machine without it)
    gptoss = str(fixture_folder("gptoss"))
    status, out, err = _main(capsys, "inspect", gptoss, "--device", "cuda")
    assert status == 0 and err == (
        "warning: the CUDA GPU was asked for but cannot be used (the CUDA GPU needs CuPy (install with `make install` "
        "on a machine with an NVIDIA driver)); every expert runs on the CPU instead\n")
    assert "All experts run on the CPU: no GPU device is in use." in out
    status, _out, err = _main(capsys, "inspect", gptoss, "--device", "cuda", "--offload", "mode=required")
    assert status == 2 and err == ("moe-workbench: error: the CUDA GPU needs CuPy (install with `make install` on a "
                                   "machine with an NVIDIA driver)\n")


def test_a_sweep_on_a_cuda_gpu_that_cannot_be_used_is_refused_before_it_runs(tmp_path, capsys, monkeypatch):
    """Without a usable GPU the sweep went on with every expert on the CPU: each point held no expert, the table read
    "0%" at every point, and it recommended (and --save-as saved) a budget of 0 measured on nothing. A sweep compares
    budgets on a device: it is refused, in one line saying why, as --device cpu is."""
    from engine.records.history import History

    monkeypatch.setitem(sys.modules, "cupy", None)  # (import cupy fails, as on a machine without it)
    history = tmp_path / "h.sqlite"
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "cuda", "--points", "2",
                             "--max-new-tokens", "2", "--history", str(history))
    assert status == 2 and out == "" and err == (
        "moe-workbench: error: a budget sweep needs a device, and the CUDA GPU cannot be used (the CUDA GPU needs CuPy "
        "(install with `make install` on a machine with an NVIDIA driver)); --device simulated gives a simulated "
        "one\n")
    assert History(history).rows() == []


def test_a_sweep_under_mode_disabled_is_refused_before_it_runs(tmp_path, capsys):
    """mode=disabled offloads nothing (every expert where the dense part runs): the sweep ran every point at budget 0,
    "0%" each, and recommended one of them. It is refused, in one line, before any run."""
    from engine.records.history import History

    history = tmp_path / "h.sqlite"
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--offload",
                             "mode=disabled", "--points", "2", "--max-new-tokens", "2", "--history", str(history))
    assert status == 2 and out == "" and err == (
        "moe-workbench: error: a budget sweep compares expert budgets, and mode=disabled offloads no expert: sweep "
        "under mode=auto or required\n")
    assert History(history).rows() == []


def test_inspect_json_on_a_cuda_gpu_that_cannot_be_used_says_in_the_json_which_device_it_planned_for_and_why(
        capsys, monkeypatch):
    """inspect --json --device cuda without CuPy planned for the CPU and said so on standard error alone: a script
    reading the JSON saw placement cpu_only and no word of the CUDA GPU asked for."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    status, out, _err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--json", "--device", "cuda")
    assert status == 0 and json.loads(out)["offload"]["device"] == {
        "asked": "cuda", "planned_for": "cpu",
        "why": "The CUDA GPU was asked for but cannot be used (the CUDA GPU needs CuPy (install with `make install` on "
               "a machine with an NVIDIA driver)); every expert runs on the CPU instead."}
    status, out, _err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--json", "--device", "simulated")
    assert status == 0 and json.loads(out)["offload"]["device"] == {"asked": "simulated", "planned_for": "simulated",
                                                                    "why": None}


def test_generate_json_on_a_cuda_gpu_that_cannot_be_used_says_in_the_json_which_device_it_ran_on_and_why(
        capsys, monkeypatch):
    """generate --json --device cuda without CuPy ran every expert on the CPU and said so on standard error alone: the
    JSON answer (its timings, its offload statistics) read as a GPU run's to a script that asked for the GPU."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    status, out, _err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--max-new-tokens",
                              "2", "--json", "--device", "cuda")
    assert status == 0 and json.loads(out)["offload"]["device"] == {
        "asked": "cuda", "ran_on": "cpu",
        "why": "The CUDA GPU was asked for but cannot be used (the CUDA GPU needs CuPy (install with `make install` on "
               "a machine with an NVIDIA driver)); every expert runs on the CPU instead."}
    status, out, _err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--max-new-tokens",
                              "2", "--json", "--device", "simulated")
    assert status == 0 and json.loads(out)["offload"]["device"] == {"asked": "simulated", "ran_on": "simulated",
                                                                    "why": None}


def test_record_says_in_each_record_why_it_ran_on_the_cpu_where_the_cuda_gpu_cannot_be_used(capsys, monkeypatch,
                                                                                            tmp_path):
    """record --device cuda on a GPU it cannot use (mode=auto) said why on standard error alone: its records said
    "cpu", as a run that chose the CPU, unlike the window's side by side. Each record now says why in the same field
    (offload["device_fallback"]). A stand-in for a CUDA GPU another process holds."""
    from engine.offload import cuda_device
    from engine.records.history import History

    busy = ("CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable device(s) "
            "is/are busy or unavailable)")
    note = f"The CUDA GPU was asked for but cannot be used ({busy}); every expert runs on the CPU instead."
    monkeypatch.setattr(cuda_device, "cuda_device_or_cpu", lambda mem_limit, mode, report, kernels=True: (None, note))
    history = tmp_path / "h.sqlite"
    status, out, err = _main(capsys, "record", str(fixture_folder("gptoss")), "--device", "cuda", "--max-new-tokens",
                             "1", "--history", str(history), "--json")
    assert status == 0 and err.splitlines()[0] == (f"warning: the CUDA GPU was asked for but cannot be used ({busy}); "
                                                   "every expert runs on the CPU instead")
    run = json.loads(out)[0]
    assert run["offload"]["device"] == "cpu" and run["offload"]["device_fallback"] == note
    assert History(history).get(run["id"]).offload["device_fallback"] == note
    status, out, _err = _main(capsys, "record", str(fixture_folder("gptoss")), "--max-new-tokens", "1", "--history",
                              str(history), "--json")  # the CPU chosen: nothing to say
    assert status == 0 and "device_fallback" not in json.loads(out)[0]["offload"]


def test_records_line_says_why_it_ran_on_the_cpu_where_the_cuda_gpu_cannot_be_used(capsys, monkeypatch, tmp_path):
    """record's line for a run whose CUDA GPU could not be used read as a run that chose the CPU: the reason was in
    the warning on standard error alone, apart from the result a script reads. The line says it too."""
    from engine.offload import cuda_device

    busy = ("CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable device(s) "
            "is/are busy or unavailable)")
    note = f"The CUDA GPU was asked for but cannot be used ({busy}); every expert runs on the CPU instead."
    monkeypatch.setattr(cuda_device, "cuda_device_or_cpu", lambda mem_limit, mode, report, kernels=True: (None, note))
    history = str(tmp_path / "h.sqlite")
    status, out, _err = _main(capsys, "record", str(fixture_folder("gptoss")), "--device", "cuda", "--max-new-tokens",
                              "1", "--history", history)
    assert status == 0 and out.startswith("short: run 1: ")
    assert out.endswith(f"; every expert ran on the CPU: the CUDA GPU asked for could not be used ({busy})\n")
    status, out, _err = _main(capsys, "record", str(fixture_folder("gptoss")), "--max-new-tokens", "1", "--history",
                              history)  # the CPU chosen: nothing to say
    assert status == 0 and "CUDA" not in out


def test_the_gpu_kernels_compiling_at_a_load_is_said_on_standard_error(capsys, monkeypatch):
    """A first generate on a GPU without a prebuilt cubin waited 1-2 minutes on NVRTC compiling the expert kernels with
    nothing printed. The device's report (CudaDevice.ensure_kernels) is a line on standard error as it comes. A simulated
    GPU stands in for the CUDA one, which reports as a load's compile would."""
    from engine.offload import SimulatedDevice
    from engine.offload import cuda_device

    def cuda_device_or_cpu(mem_limit, mode, report, kernels=True):
        report("Compiling the GPU expert kernels for sm_90 (...).")
        return SimulatedDevice(8 << 30, mem_limit=mem_limit), ""

    monkeypatch.setattr(cuda_device, "cuda_device_or_cpu", cuda_device_or_cpu)
    status, out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "hi", "--max-new-tokens",
                             "2", "--json", "--device", "cuda")
    assert status == 0 and json.loads(out)["offload"]["device"]["why"] is None
    assert err.splitlines()[0] == "Compiling the GPU expert kernels for sm_90 (...)."


def test_inspect_on_a_cuda_gpu_plans_without_compiling_the_gpu_kernels(capsys, monkeypatch):
    """A load opens the GPU with its expert kernels (a first compile: 1-2 minutes); inspect, which plans and loads
    nothing, opens it without them. A stand-in CuPy whose kernel module fails the test if asked for."""
    import kernels.gpu._module as kernel_module
    from tests.test_gpu_kernel_notice import stand_in_cupy

    def compiled(cc):
        raise AssertionError(f"inspect loaded the GPU kernels for sm_{cc}")

    stand_in_cupy(monkeypatch)
    monkeypatch.setattr(kernel_module, "load_module", compiled)
    status, out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "cuda", "--json")
    assert status == 0 and err == ""
    assert json.loads(out)["offload"]["device"] == {"asked": "cuda", "planned_for": "cuda", "why": None}


def test_inspect_says_no_host_tier_is_made_where_the_dense_part_runs_on_the_cpu(capsys, monkeypatch):
    """On a CUDA card whose dense part runs on the CPU, decode's inputs never sit in GPU memory and no decode step
    reads a host tier: the load makes none, and inspect said decode path 'tier' reads cold experts from one. It says
    why none is made, as the load does; with the dense part on the card, the tier's sentence."""
    from engine import ort_env
    from tests.test_gpu_kernel_notice import stand_in_cupy

    stand_in_cupy(monkeypatch)
    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: "onnxruntime here is the CPU build")
    args = ("inspect", str(fixture_folder("gptoss")), "--device", "cuda", "--decode-path", "tier", "--json",
            "--offload", "device_expert_bytes=0")
    status, out, _err = _main(capsys, *args)
    said = json.loads(out)["offload"]["statements"]
    assert status == 0 and ("Cold experts are computed on the CPU: no host tier is made, since the dense part runs on "
                            "the CPU (onnxruntime here is the CPU build), so decode's expert inputs never sit in GPU "
                            "memory and no decode step could read the tier.") in said, said
    assert not any("Instead, decode reads" in sentence for sentence in said)
    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    status, out, _err = _main(capsys, *args)
    said = json.loads(out)["offload"]["statements"]
    assert status == 0 and any(sentence.startswith("Instead, decode reads cold experts on the GPU from a host tier")
                               for sentence in said), said


def a_card_with_onnxruntime_gpu(monkeypatch):
    """A stand-in CUDA card, with onnxruntime's CUDA execution provider taking the dense part (the arena's check
    decides the rest)."""
    from engine import ort_env
    from tests.test_gpu_kernel_notice import stand_in_cupy

    stand_in_cupy(monkeypatch)
    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)


def test_inspect_plans_the_host_tier_away_where_the_arena_keeps_the_dense_part_on_the_cpu(capsys, monkeypatch):
    """As the load, which plans again without the tier once onnxruntime's arena did not fit beside the plan under
    gpu_device_mem_limit and the dense part stayed on the CPU (OffloadEngine.dense_landed): inspect said decode path
    'tier' reads cold experts from a tier the load does not keep. It says why none is made, with the arena's reason."""
    a_card_with_onnxruntime_gpu(monkeypatch)
    status, out, _err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "cuda", "--decode-path",
                              "tier", "--json", "--offload", "device_expert_bytes=0",
                              "--offload", f"gpu_device_mem_limit={64 << 20}")
    said = json.loads(out)["offload"]["statements"]
    assert status == 0 and any(sentence.startswith(
        "Cold experts are computed on the CPU: no host tier is made, since the dense part runs on the CPU "
        f"(gpu_device_mem_limit={64 << 20} leaves ") and sentence.endswith(
        "so decode's expert inputs never sit in GPU memory and no decode step could read the tier.")
        for sentence in said), said
    assert not any("host tier of" in sentence or "With the host tier" in sentence for sentence in said), said


def test_inspect_keeps_the_dense_part_on_the_card_without_the_host_tier_where_only_its_mappings_left_the_arena_short(
        capsys, monkeypatch):
    """As the load, which tries the card again once the plan without the tier left onnxruntime's arena the room the
    tier's device mappings took (OffloadEngine.dense_landed): inspect said the dense part runs on the CPU. Here the
    mappings (a 2 MiB granule for each of the 16 slot arrays) leave 80 MiB too little for the arena; the slots alone,
    none under device_expert_bytes=0, leave enough."""
    a_card_with_onnxruntime_gpu(monkeypatch)
    status, out, _err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "cuda", "--decode-path",
                              "tier", "--json", "--offload", "device_expert_bytes=0",
                              "--offload", f"gpu_device_mem_limit={80 << 20}")
    said = json.loads(out)["offload"]["statements"]
    no_tier = [sentence for sentence in said if "no host tier is made" in sentence]
    assert status == 0 and no_tier == [
        "Cold experts are computed on the CPU: no host tier is made, since onnxruntime's arena for the dense part fits "
        f"on the card beside the expert slots but not beside the tier's device mappings (gpu_device_mem_limit="
        f"{80 << 20} leaves 47.5 MiB after the expert slots and staging; the KV cache and state at their longest (1.5 "
        "MiB), the dense weights (618.9 KiB) and onnxruntime's workspace (64.0 MiB at least) need more (raise "
        "reserve_device_bytes or lower device_expert_bytes))."], said
    assert not any("host tier of" in sentence or "With the host tier" in sentence for sentence in said), said


def test_inspect_runs_every_expert_on_the_cpu_under_offload_disabled_where_the_arena_keeps_the_dense_part_there(
        capsys, monkeypatch):
    """mode=disabled runs every expert where the dense part runs: where onnxruntime's arena does not fit beside the
    experts under gpu_device_mem_limit, the load keeps the dense part on the CPU and plans every expert there too
    (OffloadEngine.dense_landed). inspect said all of them resident on the card, where the dense part runs."""
    a_card_with_onnxruntime_gpu(monkeypatch)
    status, out, _err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "cuda", "--json",
                              "--offload", "mode=disabled", "--offload", "reserve_device_bytes=0",
                              "--offload", f"gpu_device_mem_limit={64 << 20}")
    offload = json.loads(out)["offload"]
    said = offload["statements"]
    assert status == 0 and offload["placement"] == "cpu_only" and set(offload["slots"].values()) == {0}, said
    # the expert budgets do not apply under mode=disabled: the arena check's hint to raise or lower them is not said
    assert said == ["All experts run on the CPU: offload is disabled, and the dense part runs on the CPU "
                    f"(gpu_device_mem_limit={64 << 20} leaves 63.5 MiB after the expert slots and staging; the KV cache "
                    "and state at their longest (1.5 MiB), the dense weights (618.9 KiB) and onnxruntime's workspace "
                    "(64.0 MiB at least) need more: raise gpu_device_mem_limit, or use mode=auto, which keeps the "
                    "experts that do not fit on the CPU)."]


def test_device_options_without_a_device_are_said_to_do_nothing(capsys):
    """--layer-split and --decode-path choose how a device takes experts: with --device cpu (the default) they were
    accepted in silence, as if they had been applied."""
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--layer-split", "whole",
                              "--decode-path", "tier")
    assert status == 0 and err == ("warning: --layer-split, --decode-path: no effect with --device cpu, where every "
                                   "expert runs on the CPU (--device simulated or cuda)\n")
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "simulated",
                              "--layer-split", "whole", "--decode-path", "tier")
    assert status == 0 and err == ""
    # the simulated card's memory, with another device, was taken in silence too
    status, _out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--simulated-vram", "4000000000")
    assert status == 0 and err == ("warning: --simulated-vram: no effect with --device cpu, which simulates no GPU "
                                   "(--device simulated)\n")
    status, out, err = _main(capsys, "inspect", str(fixture_folder("gptoss")), "--device", "simulated",
                             "--simulated-vram", "4000000000")
    assert status == 0 and err == "" and "3.7 GiB (" in out


def test_a_saved_configuration_on_the_cpu_names_no_option_the_user_did_not_give(tmp_path, capsys, monkeypatch):
    """A sweep saves its layer split and decode path beside the entries, "auto" where it fixed neither: --config on the
    CPU warned that --layer-split and --decode-path, never typed, had no effect. A saved split that is not the default
    is still said, as the sweep's save said it (--config NAME also sets --layer-split whole)."""
    from engine.offload import OffloadConfig
    from engine.records import configurations

    monkeypatch.setattr(configurations, "default_path", lambda: tmp_path / "configurations.json")
    gptoss = str(fixture_folder("gptoss"))
    configurations.save_configuration("small", fixture_folder("gptoss").resolve(),
                                      OffloadConfig(device_expert_bytes=200_000),
                                      own={"layer_split": "auto", "decode_path": "auto"})
    status, _out, err = _main(capsys, "inspect", gptoss, "--config", "small")
    assert status == 0 and err == ("warning: device_expert_bytes: no effect with --device cpu, where every expert runs "
                                   "on the CPU (--device simulated or cuda)\n")
    configurations.save_configuration("whole", fixture_folder("gptoss").resolve(),
                                      OffloadConfig(device_expert_bytes=200_000),
                                      own={"layer_split": "whole", "decode_path": "auto"})
    status, _out, err = _main(capsys, "inspect", gptoss, "--config", "whole", "--decode-path", "auto")
    assert status == 0 and err.startswith("warning: --layer-split, --decode-path: no effect with --device cpu")


def test_the_simulated_cards_size_takes_units_as_the_window_does(cli):
    """--simulated-vram 8GiB (or 1.5 GB, 512M) as the window's field reads it; a size that is not one, or under 1 MiB,
    is refused by argparse naming the option."""
    for given, card in (("8GiB", "8.0 GiB ("), ("1.5 GB", "1.5 GiB ("), ("4000000000", "3.7 GiB (")):
        run = cli("inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--simulated-vram", given)
        assert run.returncode == 0 and run.stderr == "" and card in run.stdout, (given, run.stdout)
    for given, why in (("lots", "'lots' is not a size (e.g. 512 MiB, 1.5 GiB)"),
                       ("8GiBs", "'8GiBs' is not a size (e.g. 512 MiB, 1.5 GiB)"),  # as typed, not '8gibs'
                       # not taken for an option ("expected one argument")
                       ("-8GiB", "'-8GiB' is not a size (e.g. 512 MiB, 1.5 GiB)"),
                       ("20000000 TiB", "'20000000 TiB' is more than 18446744073709551615 bytes, the most a setting "
                                        "takes"),
                       ("512K", "512K: must be a size of at least 1.0 MiB"),
                       # 8 meaning 8 GiB, or 1.5 GB unquoted, whose unit the shell gives argparse apart
                       ("8", "8: a number without a unit is bytes; a size here is at least 1.0 MiB (8GiB, 512MiB)"),
                       ("1.5", "1.5: a number without a unit is bytes; a size here is at least 1.0 MiB (8GiB, 512MiB)")):
        run = cli("inspect", str(fixture_folder("gptoss")), "--device", "simulated", "--simulated-vram", given)
        assert run.returncode == 2 and f"argument --simulated-vram: {why}\n" in run.stderr, run.stderr


def test_generate_seeds_sampling_with_the_models_random_seed_unless_given_one(copy_fixture, capsys):
    """genai_config.json's search.random_seed seeds sampling where --seed is not given (onnxruntime-genai's -1: none,
    a fresh seed each run); --seed replaces it."""
    folder = copy_fixture("qwen35moe")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"].update(do_sample=True, temperature=2.0, top_k=0, random_seed=5)
    (folder / "genai_config.json").write_text(json.dumps(config))
    run = ("generate", str(folder), "--prompt", "hi", "--max-new-tokens", "8", "--json")
    status, out, err = _main(capsys, *run)
    assert status == 0 and "says: temperature 2, seed 5 (--greedy for greedy answers)" in err
    assert json.loads(out)["tokens"] == json.loads(_main(capsys, *run, "--seed", "5")[1])["tokens"]
    sampled = json.loads(_main(capsys, *run, "--temperature", "2")[1])["tokens"]  # the user's sampling, its seed
    assert sampled == json.loads(_main(capsys, *run, "--temperature", "2", "--seed", "5")[1])["tokens"]


def test_generate_says_in_one_line_that_it_does_no_beam_search(copy_fixture, capsys):
    """A genai_config.json asking for beam search (search.num_beams above 1, copied from the model's generation
    config) gets one sequence here: said, rather than answered greedily without a word."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["num_beams"] = 4
    (folder / "genai_config.json").write_text(json.dumps(config))
    status, _out, err = _main(capsys, "generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--json")
    warnings = [line for line in err.splitlines() if "beam" in line]
    assert status == 0 and warnings == [
        "warning: the model's genai_config.json asks for beam search (search.num_beams 4), which MoE Workbench does "
        "not do: its answers are one sequence, greedy or sampled"]
    config["search"]["num_beams"] = 1
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert "beam" not in _main(capsys, "generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2")[2]


def test_record_and_history_say_an_approximate_runs_token_agreement(tmp_path, capsys):
    """record's line and history's list said nothing of approximate routing: a run that dropped experts read as an
    exact one that merely ran faster. Both now say the run's token agreement with exact routing, as generate does."""
    gptoss, history = str(fixture_folder("gptoss")), str(tmp_path / "h.sqlite")
    approximate = ("--device", "simulated", "--offload", "device_expert_bytes=0", "--offload", "min_expert_weight=0.5")
    status, out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "6", "--history", history, *approximate)
    assert status == 0, err
    status, exact_out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "6", "--history", history)
    assert status == 0, err
    record = json.loads(_main(capsys, "history", "--history", history, "--id", "1")[1])[0]
    agreement, tokens = record["routing_agreement"], record["turns"][0]["generated_tokens"]
    said = f"token agreement with exact routing {agreement:.0%} ({round(agreement * tokens)} of {tokens} tokens)"
    assert out.rstrip().endswith(f"; {said}") and "agreement" not in exact_out
    exact_line, approximate_line = _main(capsys, "history", "--history", history)[1].splitlines()  # newest first
    assert approximate_line.endswith(f"6 tokens  (approximate routing; {said})  {gptoss}")
    assert exact_line.endswith(f"6 tokens  {gptoss}")


def test_a_sweep_with_approximate_routing_says_each_points_token_agreement(tmp_path, capsys):
    """A sweep under approximate routing recommends a budget within the margin of the fastest (usually the smallest
    there), and a smaller budget has more cold experts to drop: its table and JSON said nothing of what that cost in answers. Each
    point now says its token agreement with exact routing, over its answers' tokens (its records')."""
    from engine.records.history import History

    history = str(tmp_path / "h.sqlite")
    args = ("sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2", "--max-new-tokens", "6",
            "--history", history, "--offload", "min_expert_weight=0.5", "--offload", "skip_tail_cold_only=1")
    status, out, err = _main(capsys, *args, "--json")
    assert status == 0, err
    agreement = {int(row["budget"]): row["routing_agreement"] for row in History(history).rows()}  # its records'
    points = json.loads(out)["points"]
    assert [p["routing_agreement"] for p in points] == [agreement[p["budget_bytes"]] for p in points]
    status, out, err = _main(capsys, *args)
    assert status == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.strip().startswith("budget"))
    assert _columns(header)[-1] == "agreement"
    rows = [_columns(line) for line in lines[lines.index(header) + 1:]]
    agreement = {int(row["budget"]): row["routing_agreement"] for row in History(history).rows()[:6]}  # this sweep's
    column = len(_columns(header)) - 1  # (the recommended row has its mark after it)
    assert [row[column] for row in rows] == [f"{agreement[int(row[0])]:.0%}" for row in rows]
    exact = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--points", "2",
                  "--max-new-tokens", "2", "--history", history)[1]
    assert "agreement" not in exact


def test_a_narrowing_routing_setting_without_the_one_it_narrows_is_said_to_do_nothing(tmp_path, capsys):
    """skip_tail_cold_only only narrows what min_expert_weight drops, tail_substitution_min_rank only where
    tail_substitution_threshold substitutes: given alone they were taken silently, routing exact (no agreement said),
    where a user may think approximate routing on. The command line says so, as it does for mode=disabled."""
    gptoss = str(fixture_folder("gptoss"))
    status, _out, err = _main(capsys, "generate", gptoss, "--prompt", "Hello", "--max-new-tokens", "2", "--device",
                              "simulated", "--offload", "skip_tail_cold_only=1", "--offload",
                              "tail_substitution_min_rank=0")
    assert status == 0, err
    assert [line for line in err.splitlines() if line.startswith("warning")] == [
        "warning: skip_tail_cold_only=1: no effect without min_expert_weight, whose drops it narrows to cold experts",
        "warning: tail_substitution_min_rank=0: no effect without tail_substitution_threshold, whose substitutions "
        "it narrows to these ranks"]
    assert "agreement" not in err
    status, _out, err = _main(capsys, "generate", gptoss, "--prompt", "Hello", "--max-new-tokens", "2", "--device",
                              "simulated", "--offload", "skip_tail_cold_only=1", "--offload", "min_expert_weight=0.5")
    assert status == 0 and "warning" not in err and "token agreement with exact routing" in err


def test_records_line_on_the_simulated_device_says_the_projected_card_and_its_device_peak(tmp_path, capsys):
    """On the simulated device record's line gave only the measured times, in which the CPU stands in for the card's
    experts one after the other, and no device memory: read as the card's speed and use. It now also says the device
    peak (of the card's memory) and what the record projects for the simulated card, with the bandwidths assumed."""
    gptoss, history = str(fixture_folder("gptoss")), str(tmp_path / "h.sqlite")
    status, out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "6", "--history", history, "--device",
                             "simulated", "--simulated-vram", "4000000", "--offload", "device_expert_bytes=300000")
    assert status == 0, err
    record = json.loads(_main(capsys, "history", "--history", history, "--id", "1")[1])[0]
    projected, peak = record["timings"]["projected"], record["peaks"]["device_bytes"]
    assert peak > 300000 // 2
    parts = " + ".join(f"{name} {human_bytes(n)}" for name, n in record["peaks"]["device_parts"].items())
    assert (f"device peak {human_bytes(peak)} of 3.8 MiB ({parts}); projected for the simulated card (PCIe 25 GB/s, "
            f"HBM 1000 GB/s assumed; the times before are the CPU's, standing in for it): decode "
            f"{projected['decode_tokens_per_s']:.1f} tok/s, completion {duration_text(projected['completion_s'])}"
            ) in out
    status, out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "2", "--history", history)
    assert status == 0 and "device peak" not in out and "projected" not in out



def test_records_device_peak_says_what_it_is_made_of_as_a_sweeps_does(tmp_path, capsys):
    """record's line said "device peak 32.5 MiB of 3.8 MiB" with no breakdown, where a sweep's says its points' parts:
    with the host tier 32 MiB of it are the tier's granule-rounded device mappings, not experts. The line names the
    parts held at the peak, which add up to it, and the record keeps them (peaks.device_parts, in --json too)."""
    gptoss, history = str(fixture_folder("gptoss")), str(tmp_path / "h.sqlite")
    status, out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "2", "--history", history, "--device",
                             "simulated", "--decode-path", "tier", "--offload", "device_expert_bytes=0", "--json")
    assert status == 0, err
    peaks = json.loads(out)[0]["peaks"]
    ring = peaks["device_parts"]["prefill staging ring"]
    assert peaks["device_parts"] == {"host tier mappings": 16 * (2 << 20), "prefill staging ring": ring}
    assert sum(peaks["device_parts"].values()) == peaks["device_bytes"]
    status, out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "2", "--history", history, "--device",
                             "simulated", "--decode-path", "tier", "--offload", "device_expert_bytes=0")
    assert status == 0, err
    assert (f"; device peak {human_bytes(peaks['device_bytes'])} of 8.0 GiB (host tier mappings 32.0 MiB + prefill "
            f"staging ring {human_bytes(ring)}: the host tier maps each slot array's device rows rounded up to the "
            "2.0 MiB mapping granule, a granule even with no slot)") in out
    status, out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "2", "--history", history, "--device",
                             "simulated", "--decode-path", "cpu")
    assert status == 0, err
    assert f"of 8.0 GiB (expert slots 552.0 KiB + prefill staging ring {human_bytes(ring)}); projected" in out


def test_records_line_gives_its_rss_peak_in_the_unit_that_tells_it_from_the_start(tmp_path, capsys):
    """record's line said "peak RSS 223 MiB (223 at the start)" in whole MiB: a small model's run, which adds a few
    hundred KiB, read as adding nothing (the sweep's table gives 224.3 MiB). Both are given as the table gives them."""
    history = str(tmp_path / "h.sqlite")
    status, out, err = _main(capsys, "record", str(fixture_folder("gptoss")), "--max-new-tokens", "2", "--history",
                             history)
    assert status == 0, err
    peaks = json.loads(_main(capsys, "history", "--history", history, "--id", "1")[1])[0]["peaks"]
    assert (f"peak RSS {human_bytes(peaks['rss_bytes'])} ({human_bytes(peaks['rss_start_bytes'])} at the start)"
            in out)


def test_generate_on_the_simulated_device_says_the_decode_rate_projected_for_the_card():
    """generate on the simulated device said only the measured decode rate, in which the CPU computes the card's
    experts too, one after the other: read as the card's. Its line and --json now also give the rate projected for the
    simulated card, as the window's chat does (the answer's decode time less what the card would not spend)."""
    gptoss = str(fixture_folder("gptoss"))
    common = ("generate", gptoss, "--prompt", "Hello there", "--greedy", "--max-new-tokens", "8", "--device",
              "simulated", "--offload", "device_expert_bytes=300000")
    result = run_cli(*common, "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    timings, decode = answer["timings"], answer["offload"]["phases"]["decode"]
    saving = decode["standin_s"] + decode["cpu_s"] - decode["critical_s"]  # the whole run is this one answer
    expected = (timings["generated_tokens"] - 1) / (timings["decode_s"] - saving)
    assert abs(timings["projected_decode_tokens_per_s"] - expected) < 1e-6 * expected
    result = run_cli(*common)
    assert result.returncode == 0, result.stderr
    assert re.search(r"tok/s, [0-9.]+ (?:s|ms|µs), projected on the simulated card: [0-9.]+ tok/s; length\]",
                     result.stderr)
    assert "projected" not in run_cli(*common[:-4]).stderr  # on the CPU


def test_history_gives_a_simulated_runs_projected_completion_beside_the_measured_one(tmp_path, capsys):
    """history's list gave a simulated-GPU run's measured completion alone, in which the CPU computes the card's
    experts too: beside a run on a real card it read as the card's. It now also gives the completion projected for
    the simulated card, as record's line does."""
    gptoss, history = str(fixture_folder("gptoss")), str(tmp_path / "h.sqlite")
    for device in (("--device", "simulated"), ()):
        status, _out, err = _main(capsys, "record", gptoss, "--max-new-tokens", "2", "--history", history, *device)
        assert status == 0, err
    simulated = json.loads(_main(capsys, "history", "--history", history, "--id", "1")[1])[0]["timings"]
    cpu_line, simulated_line = _main(capsys, "history", "--history", history)[1].splitlines()  # newest first
    assert (f"completion {duration_text(simulated['completion_s'])} (projected for the simulated card "
            f"{duration_text(simulated['projected']['completion_s'])})  2 tokens") in simulated_line
    assert "projected" not in cpu_line


def test_the_gpu_out_of_memory_is_an_error_the_user_can_act_on_not_an_internal_one(capsys, monkeypatch):
    """CuPy's OutOfMemoryError (or the runtime's cudaErrorMemoryAllocation) out of a command read "internal error",
    exit status 3, as a defect of ours would, though its line says what to do: it is an error, status 2, as a sweep's
    point that ran out of memory is."""
    import app.cli as cli

    class OutOfMemoryError(MemoryError):  # CuPy's name (cupy.cuda.memory.OutOfMemoryError)
        pass

    for raised in (OutOfMemoryError("Out of memory allocating 2,147,483,648 bytes (allocated so far: 0 bytes)."),
                   RuntimeError("cudaErrorMemoryAllocation: out of memory")):
        def generate(_args, raised=raised):
            raise raised

        monkeypatch.setattr(cli, "_cmd_generate", generate)
        status, _out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "hello")
        assert status == 2 and err.startswith(f"moe-workbench: error: {type(raised).__name__}: "), err
        assert err.rstrip().endswith("the GPU ran out of memory: lower the expert budget (device_expert_bytes) or "
                                     "free what other processes hold on the GPU")
    monkeypatch.setattr(cli, "_cmd_generate", lambda _args: 1 / 0)  # a defect of ours stays one
    status, _out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "hello")
    assert status == 3 and err.startswith("moe-workbench: internal error: ZeroDivisionError")


def last_error_line_by_mode(capsys, modes) -> dict[str, str]:
    """`generate` on the simulated device under each offload mode, failing with status 2: its last stderr line."""
    said = {}
    for mode in modes:
        status, _out, err = _main(capsys, "generate", str(fixture_folder("gptoss")), "--prompt", "hello", "--device",
                                  "simulated", "--offload", f"mode={mode}")
        assert status == 2, err
        said[mode] = err.strip().splitlines()[-1]
    return said


def test_the_gpu_out_of_memory_under_offload_disabled_does_not_advise_the_expert_budget(capsys, monkeypatch):
    """The GPU out of memory said "lower the expert budget (device_expert_bytes)" whatever the mode, also under
    mode=disabled, where every expert goes beside the dense part and the expert budgets do not apply; there it says
    what frees the card's memory under that mode. Under mode=auto the budget's advice stays."""
    from engine import generation

    class OutOfMemoryError(MemoryError):  # CuPy's name
        pass

    def open_model(*args, **kwargs):  # the load runs out of the card's memory
        raise OutOfMemoryError("Out of memory allocating 2,147,483,648 bytes (allocated so far: 0 bytes).")

    monkeypatch.setattr(generation.LoadedModel, "open", open_model)
    said = last_error_line_by_mode(capsys, ("disabled", "auto"))
    assert said["disabled"] == ("moe-workbench: error: OutOfMemoryError: Out of memory allocating 2,147,483,648 bytes "
                                "(allocated so far: 0 bytes).; the GPU ran out of memory: use mode=auto, which keeps "
                                "the experts that do not fit on the CPU, or free what other processes hold on the GPU")
    assert said["auto"].endswith("; the GPU ran out of memory: lower the expert budget (device_expert_bytes) or free "
                                 "what other processes hold on the GPU")


def test_the_dense_part_out_of_gpu_memory_under_offload_disabled_does_not_advise_the_expert_budget(capsys,
                                                                                                  monkeypatch):
    """onnxruntime running out of the card's memory in a dense part is said as a WorkbenchError naming the part, which
    DenseSegment.run words without knowing the offload mode: under mode=disabled it still advised lowering
    device_expert_bytes, which no expert budget there obeys. It says what frees the card's memory under that mode."""
    from engine import dense_segment

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory ; GPU=0")

    monkeypatch.setattr(dense_segment, "run_bound", out_of_memory)
    said = last_error_line_by_mode(capsys, ("disabled", "auto"))
    assert said["disabled"].startswith("moe-workbench: error: ")
    assert "onnxruntime failed to run the dense part" in said["disabled"]
    assert said["disabled"].endswith(": RuntimeError: CUDA failure 2: out of memory ; GPU=0; the GPU ran out of "
                                     "memory: use mode=auto, which keeps the experts that do not fit on the CPU, or "
                                     "free what other processes hold on the GPU")
    assert said["auto"].endswith("; GPU=0; the GPU ran out of memory: lower the expert budget (device_expert_bytes) or "
                                 "free what other processes hold on the GPU")


def test_free_text_that_starts_with_a_dash_is_the_options_value(cli):
    """`--prompt -hi` was refused with argparse's "argument --prompt: expected one argument" (it took -hi for an
    option, as it does any word that starts with '-' but a negative number): free text takes one. An option's name
    there is still taken for the option (`--prompt --json` has no prompt), and the refusal says how to give such a
    value."""
    from engine.tokenizer import ModelTokenizer

    gptoss = str(fixture_folder("gptoss"))
    for prompt in ("-hi", "-h is help", "--- notes"):
        result = cli("generate", gptoss, "--prompt", prompt, "--raw", "--max-new-tokens", "1", "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["prompt_tokens"] == ModelTokenizer(gptoss).encode(prompt,
                                                                                           add_special_tokens=True)
    from app.cli import _build_parser, _option_names, _values_attached

    parser = _build_parser()
    for argv, dest, value in ((["generate", gptoss, "--prompt", "hi", "--system", "-be brief"], "system", "-be brief"),
                              (["generate", gptoss, "--prompt", "hi", "--stop", "-x"], "stop", ["-x"]),
                              (["record", gptoss, "--label", "-q4"], "label", "-q4"),
                              (["history", "--model", "-q4", "--label", "--x"], "model", "-q4")):
        assert getattr(parser.parse_args(_values_attached(argv, _option_names(parser))), dest) == value
    for prompt in ("--json", "--js", "-h"):  # (--js: argparse's abbreviation of --json)
        result = cli("generate", gptoss, "--prompt", prompt)
        assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
            "moe-workbench generate: error: argument --prompt: expected one argument (one that starts with '-' is "
            "given as --prompt=VALUE)"), result.stderr


def test_a_free_text_option_that_ends_the_line_is_said_to_lack_its_value(cli):
    """`generate M --prompt`, the line ended before the prompt, was told how to give a value that starts with '-'
    (--prompt=VALUE), as if one had been given: it is told the value is missing. An option's name after it keeps
    that hint."""
    gptoss = str(fixture_folder("gptoss"))
    for argv, option in ((("generate", gptoss, "--prompt"), "--prompt"),
                         (("generate", gptoss, "--prom"), "--prompt"),  # (argparse's abbreviation)
                         (("generate", gptoss, "--prompt", "hi", "--stop"), "--stop"),
                         (("history", "--model"), "--model")):
        result = cli(*argv)
        assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
            f"moe-workbench {argv[0]}: error: argument {option}: expected one argument (its value is missing at the "
            "end of the line)"), result.stderr
    result = cli("generate", gptoss, "--prompt", "--json")
    assert result.returncode == 2 and result.stderr.splitlines()[-1].endswith(
        "(one that starts with '-' is given as --prompt=VALUE)"), result.stderr


def test_a_reasoning_setting_the_template_lacks_is_named_as_the_option(copy_fixture, cli):
    """generate named --reasoning's value as the window's setting ("reasoning 'high'"), not the option typed."""
    from tests.test_reasoning_templates import qwen3_folder

    result = cli("generate", str(qwen3_folder(copy_fixture)), "--prompt", "hi", "--reasoning", "high")
    assert result.returncode == 2 and result.stderr == ("moe-workbench: error: --reasoning 'high': this model's chat "
                                                        "template takes on, off\n"), result.stderr


def test_a_number_option_refused_is_quoted_as_typed(cli):
    """`--temperature -1` was refused as "got -1.0", a value never typed (argparse's float, printed): the number
    options' values are said as typed, as sizes are, and argparse's own refusal names a number."""
    gptoss = str(fixture_folder("gptoss"))
    for option, typed, said in (("--temperature", "-1", "--temperature must be a number >= 0, got -1"),
                                ("--top-p", "1.50", "--top-p must be in [0, 1], got 1.50"),
                                ("--repetition-penalty", "-.50",
                                 "--repetition-penalty must be a number > 0, got -.50")):
        result = cli("generate", gptoss, "--prompt", "hi", "--temperature", "0.7", option, typed)
        assert result.returncode == 2 and result.stderr == f"moe-workbench: error: {said}\n", result.stderr
    result = cli("sweep", gptoss, "--device", "simulated", "--margin", "-1")
    assert result.returncode == 2 and result.stderr == ("moe-workbench: error: --margin -1: a share of the fastest "
                                                        "completion, 0 or more (0.1 = 10%)\n"), result.stderr
    result = cli("generate", gptoss, "--prompt", "hi", "--temperature", "warm")
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        "moe-workbench generate: error: argument --temperature: invalid number value: 'warm'")


def test_a_negative_number_in_exponent_form_is_taken_as_a_value(cli):
    """`--temperature -1e-3` was refused as "expected one argument" (argparse took it for an option's name, where it
    takes -1 and -.5 for values): it is read as the number it is, and refused for its sign as -1 is."""
    gptoss = str(fixture_folder("gptoss"))
    for typed in ("-1e-3", "-2.5E+1"):
        result = cli("generate", gptoss, "--prompt", "hi", "--temperature", typed)
        assert result.returncode == 2 and result.stderr == (
            f"moe-workbench: error: --temperature must be a number >= 0, got {typed}\n"), result.stderr


def test_argparse_reads_the_negative_number_matcher_the_parser_replaces():
    """The command line's parser replaces argparse's private _negative_number_matcher (argparse 3.11 to 3.13 have no
    public way to take -1e-3 for a value): an argparse that dropped it would refuse -1e-3 again, unnoticed where the
    version testing takes such a number itself (3.14). Here a word no argparse takes for a number is."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--value")
    parser._negative_number_matcher = re.compile(r"^-zz$")
    assert parser.parse_args(["--value", "-zz"]).value == "-zz"


def test_max_new_tokens_help_and_the_readme_say_what_the_option_and_write_model_do():
    """--max-new-tokens' help began "answer length limit" and --scenario's spoke of "the answer length", the window's
    name, where the option is --max-new-tokens; the README did not say write-model checks the disk's free space (and
    now the memory) before it writes, or how a free-text value that starts with '-' is given."""
    import argparse

    from app.cli import _build_parser

    commands = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    said = {name: next(a.help for a in commands[name]._actions if a.dest == "max_new_tokens")
            for name in ("generate", "record", "sweep", "contention")}
    assert said["generate"] == ("the most tokens an answer generates (default 128; for a model that reasons first, "
                                "room for an answer after the reasoning: its genai_config.json's search.max_length, "
                                "within its context, at most 32768)")
    assert said["sweep"].startswith("the most tokens an answer generates, the same for every model (default 32: ")
    assert all(text.startswith("the most tokens an answer generates (default 64; ") and "answer length" not in text
               for text in (said["record"], said["contention"]))
    readme = (REPO / "README.md").read_text().replace("\n", " ")
    assert ("Before it builds or writes anything it counts what the model takes on a graph of a few layers, and "
            "refuses at once weights larger than the disk's free space there, a graph (`model.onnx`) past the 2 GiB "
            "one protobuf file holds, or a model whose writing takes more memory than is available") in readme
    assert ("A free-text value may start with `-` (`--prompt -hi`, and so `--system`, `--stop`, `--label` and "
            "`history`'s `--model`); one that is an option's name is given with `=` (`--prompt=--json`).") in readme


def test_a_sweeps_json_says_how_its_answers_were_asked_for_as_its_records_keep_it(tmp_path, capsys):
    """sweep --json gave no sampling or reasoning setting: only each point's records in the history kept them. Its
    object's `generation` says them, as every record of the sweep keeps them."""
    from engine.records.history import History

    history = str(tmp_path / "h.sqlite")
    status, out, err = _main(capsys, "sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--history",
                             history, "--points", "2", "--max-new-tokens", "2", "--scenario", "short", "--repeats",
                             "1", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "11", "--json")
    assert status == 0, err
    printed = json.loads(out)
    assert printed["generation"] == {"max_new_tokens": 2, "do_sample": True, "temperature": 0.7, "top_k": 5,
                                     "top_p": 0.9, "repetition_penalty": 1.0, "seed": 11,
                                     "stop_strings": [], "reasoning": None}
    saved = History(history)
    ids = [run_id for point in printed["points"] for run_id in point["record_ids"]]
    assert len(ids) == 2 and all(saved.get(run_id).generation == printed["generation"] for run_id in ids)
