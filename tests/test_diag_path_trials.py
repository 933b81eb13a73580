"""benchmarks/diag_path_trials.py: each decode step's line and the "both" window's end, on the simulated device."""
import numpy as np


def test_each_steps_line_and_the_both_windows_end_show_every_layers_table(tmp_path, capsys):
    """Under "both" the split's tables are per layer (copy_state's cold_split "tables"); the lines showed the first
    device layer's alone, so layer 2's own table (here fixed apart from layers 0-1's) was never seen. Each step's line
    and the "both" window's last line give each distinct table with its layers."""
    from benchmarks.diag_path_trials import both_window, count_runs, run_steps
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import all_resident_bytes
    from engine.writer import write_model
    from tests.test_offload import SPEC

    folder = write_model(tmp_path / "m", SPEC)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30),
                             decode_path="both")
    model.offload.reconfigure(OffloadConfig(device_expert_bytes=all_resident_bytes(model.folder.experts) // 4),
                              decode_path="both")
    given = [np.array(table) for table in ([0, 1, 1, 2, 2], [0, 1, 1, 2, 2], [0, 0, 1, 1, 2])]
    model.offload.fix_split_tables(lambda layer: (given[layer], None))
    runs, state = count_runs(model), model.new_state()
    token = int(model.decoder.forward(state, [5, 6, 7])[-1].argmax())
    token, step_ms = run_steps(model, state, token, 2, runs)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(step_ms) == 2
    assert all(" both/   -  " in line and "table 0,1,1,2,2 in layers 0-1; 0,0,1,1,2 in layer 2  " in line
               for line in lines)
    both_window(model, state, token, 4, runs, None, True)
    assert "; table 0,1,1,2,2 in layers 0-1; 0,0,1,1,2 in layer 2, 0 slow steps left out in the window\n" in \
        capsys.readouterr().out


def test_each_steps_line_says_the_cpu_rate_in_force_with_the_measured_one_beside_it(tmp_path, capsys):
    """A step's line gave the CPU rate as measured, where the split's tables price a CPU miss at the rate clamped to
    the host's streaming read (cpu_bytes_per_s): it gives the rate in force, the measured one beside it."""
    from benchmarks.diag_path_trials import count_runs, run_steps
    from engine.writer import write_model
    from tests.test_offload import SPEC, clamped_rates_model

    model = clamped_rates_model(write_model(tmp_path / "m", SPEC))  # 60 GB/s + 100 µs measured, 40 GB/s streaming
    state = model.new_state()
    token = int(model.decoder.forward(state, [5, 6, 7])[-1].argmax())
    run_steps(model, state, token, 1, count_runs(model))
    assert "  40.0 GB/s+   6 (measured 60.0 GB/s + 100)  " in capsys.readouterr().out  # the measured line's own


def test_each_steps_line_says_no_rate_before_one_is_measured_and_small_rates_in_mb_s(tmp_path, capsys):
    """A CPU rate not measured yet read "0.0 kB/s + 0", as if the CPU cost nothing, and the tier's reads were printed
    in GB/s with one decimal, so 40 MB/s read "0.0" and none measured "0.0" too. The line says "no rate" for either,
    and a rate in MB/s under 1 GB/s (units.byte_rate)."""
    from benchmarks.diag_path_trials import count_runs, run_steps
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import all_resident_bytes
    from engine.writer import write_model
    from tests.test_offload import SPEC

    model = LoadedModel.open(write_model(tmp_path / "m", SPEC), device=SimulatedDevice(1 << 30), decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=0))
    model.offload.reconfigure(OffloadConfig(device_expert_bytes=all_resident_bytes(model.folder.experts) // 4),
                              decode_path="both")
    engine = model.offload
    for rate in (engine.cpu_rate, engine.split_rate):  # none measured: this machine's calls would give one
        rate.observe = rate.observe_many = lambda *calls: None
    engine.tier_read.observe = lambda *read: None
    state, runs = model.new_state(), count_runs(model)
    token = int(model.decoder.forward(state, [5, 6, 7])[-1].argmax())
    token, _ = run_steps(model, state, token, 1, runs)
    assert "     no rate     no rate  " in capsys.readouterr().out
    engine.tier_read.value = 0.04e9
    run_steps(model, state, token, 1, runs)
    assert "     no rate   40.0 MB/s  " in capsys.readouterr().out
