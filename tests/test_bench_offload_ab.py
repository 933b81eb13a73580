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
    with pytest.raises(SystemExit, match=r"variant item \"''\" is not key=value"):
        variant("''")  # what AB="--b ''" hands over through gpu_offload_run.sh's word splitting


def test_the_summary_pairs_each_round_of_b_with_the_round_of_a_beside_it():
    result = summary({"A": [10.0, 20.0, 30.0], "B": [11.0, 18.0, 36.0]})
    assert result["a_median"] == 20.0 and result["b_median"] == 18.0
    assert result["ratio_min"] == pytest.approx(0.9) and result["ratio_max"] == pytest.approx(1.2)
    assert result["ratio_median"] == pytest.approx(1.1)  # per-round ratios 1.1, 0.9, 1.2: not 18 / 20


def test_switches_are_read_apart_from_the_offload_keys():
    from benchmarks.bench_offload_ab import switches

    text = "cpu_threads=15,gpu.driver_copies=0, gpu.batch_copies=1,dense.graphs=1,cpu.gemv_chunk_kb=16"
    assert variant(text) == {"cpu_threads": 15}  # an offload key, though it starts with "cpu"
    assert switches(text) == {"gpu.driver_copies": 0, "gpu.batch_copies": 1, "dense.graphs": 1,
                              "cpu.gemv_chunk_kb": 16}
    assert switches("") == {}
    with pytest.raises(SystemExit, match="gpu.driver_copies=off: a switch takes an integer"):
        switches("gpu.driver_copies=off")
    assert switches("dense.relaunch=0,dense.ahead=0") == {"dense.relaunch": 0, "dense.ahead": 0}
    with pytest.raises(SystemExit,
                       match="dense.pool=1: the dense switches are dense.graphs, dense.relaunch, dense.ahead"):
        switches("dense.pool=1")


def test_a_dense_switch_sets_its_modules_flag(monkeypatch):
    import benchmarks.bench_offload_ab as ab
    from engine import decoder

    monkeypatch.setattr(decoder, "launch_ahead", True)
    assert ab.current_switches(None, {"dense.ahead"}) == {"dense.ahead": 1}
    ab.set_switches(None, {"dense.ahead": 0})
    assert decoder.launch_ahead is False and ab.current_switches(None, {"dense.ahead"}) == {"dense.ahead": 0}
    from kernels.cpu import omp_pool

    monkeypatch.setattr(omp_pool, "enabled", True)
    ab.set_switches(None, {"dense.pool_back": 0})  # pools kept: release_pool gives nothing back
    assert omp_pool.enabled is False and omp_pool.release_pool() is False


class _Kernel:
    def __init__(self):
        self.driver_copies = True


class _CpuKernel:
    gemv_chunk_kb = 64


class _Engine:
    """The parts of OffloadEngine the A/B reads: stores (one without a GPU kernel), the streaming slots (shared by
    two layers), and reconfigure, which makes new kernels as a budget change would."""

    def __init__(self):
        self.reconfigured = []
        self.reconfigure(None)

    def reconfigure(self, config, layer_split=None, decode_path=None):
        from engine.offload.decode_path import DecodePathTrials

        self.reconfigured.append(config)
        self.split, self.path = layer_split, decode_path
        self.path_trials = DecodePathTrials()  # started again, as a re-plan does
        shared = type("Group", (), {"gpu": _Kernel()})()
        self.stores = [type("Slots", (), {"gpu": _Kernel()})(), None, type("Sim", (), {})()]
        self.streaming = type("Plan", (), {"by_layer": [shared, None, shared]})()

    def path_trials_run(self):
        return self.path == "auto"  # (the real engine: and a host tier, cpu_execution auto)


def test_paired_rounds_set_each_variants_switches_after_reconfiguring(monkeypatch):
    import benchmarks.bench_offload_ab as ab
    from engine import dense_graph

    cpu = _CpuKernel()  # shared by two nodes' runners, as a node's kernel is its runner's
    steps = [type("Node", (), {"kernel": cpu})(), type("Segment", (), {})(), type("Node", (), {"kernel": cpu})()]
    decoder = type("Decoder", (), {"steps": steps, "layers_ahead": 0, "layers_beside": 0, "steps_run_again": 0})()
    model = type("Model", (), {"offload": _Engine(), "decoder": decoder})()
    seen = []

    def fake_decode(model, prompt, tokens, warmup=4):
        assert warmup == 32  # the default warm-up: no trial to wait for, the paths are given
        kernels = ab.gpu_kernels(model)
        assert len(kernels) == 2  # the node's and the shared streaming slots', once
        assert ab.cpu_kernels(model) == [cpu]
        seen.append(([k.driver_copies for k in kernels], dense_graph.enabled, cpu.gemv_chunk_kb, model.offload.split,
                     model.offload.path))
        return (100.0 if kernels[0].driver_copies else 90.0), []

    monkeypatch.setattr(ab, "decode", fake_decode)
    monkeypatch.setattr(dense_graph, "enabled", False)
    rates = ab.paired_rounds(model, 1 << 20, {"A": {}, "B": {}}, 3, [1], 4,
                             {"A": {}, "B": {"gpu.driver_copies": 0, "dense.graphs": 1, "cpu.gemv_chunk_kb": 16}},
                             {"A": "spread", "B": "whole"}, paths={"A": "cpu", "B": "tier"})
    # rounds alternate A B / B A / A B; A keeps the defaults (driver copies on, no graphs, 64 KB chunks), B sets its
    # switches; each its layer split and decode path
    a, b = ([1, 1], False, 64, "spread", "cpu"), ([0, 0], True, 16, "whole", "tier")
    assert seen == [a, b, b, a, a, b]
    assert rates == {"A": [100.0] * 3, "B": [90.0] * 3}
    # B's switches taken back after its last round: the next budget's rounds find the defaults
    assert dense_graph.enabled is False and cpu.gemv_chunk_kb == 64
    with pytest.raises(SystemExit, match="gpu.no_such: GpuQMoE has no such switch"):
        ab.set_switches(model, {"gpu.no_such": 1})
    with pytest.raises(SystemExit, match="cpu.no_such: the CPU expert kernel has no such switch"):
        ab.set_switches(model, {"cpu.no_such": 1})


def test_rate_switches_set_the_engines_cpu_rate():
    import benchmarks.bench_offload_ab as ab
    from engine.offload.miss_policy import CpuRate

    rate, split_rate = CpuRate(min_calls=2), CpuRate(min_calls=2)
    for nbytes, seconds in ((1e6, 2e-4), (3e6, 4e-4), (5e6, 6e-4)):  # 100 µs + 1e-10 s a byte
        rate.observe(int(nbytes), seconds)
        split_rate.observe(int(nbytes), seconds)
    model = type("Model", (), {"offload": type("Engine", (), {"cpu_rate": rate, "split_rate": split_rate})()})()
    assert ab.switches("rate.fit=0") == {"rate.fit": 0}
    assert ab.current_switches(model, {"rate.fit"}) == {"rate.fit": 1}
    assert rate.fixed_s == pytest.approx(1e-4)
    ab.set_switches(model, {"rate.fit": 0})  # the CPU path's rate and the "both" parts' alike
    assert rate.fixed_s == 0.0 and rate.value == pytest.approx(rate.average)
    assert split_rate.fixed_s == 0.0 and split_rate.value == pytest.approx(split_rate.average)
    with pytest.raises(SystemExit, match="rate.no_such: the CPU rate has no such switch"):
        ab.set_switches(model, {"rate.no_such": 1})


def test_a_rate_without_a_ceiling_is_set_back_without_one():
    """The simulated device's CPU rate has no ceiling and no stream (None): a variant that sets one is undone."""
    import benchmarks.bench_offload_ab as ab
    from engine.offload.miss_policy import CpuRate

    rate = CpuRate()
    model = type("Model", (), {"offload": type("Engine", (), {"cpu_rate": rate, "split_rate": CpuRate()})()})()
    defaults = ab.current_switches(model, {"rate.ceiling", "rate.stream"})
    assert defaults == {"rate.ceiling": None, "rate.stream": None}
    ab.set_switches(model, {"rate.ceiling": 5e10})
    ab.set_switches(model, defaults)
    assert rate.ceiling is None and rate.stream is None


def test_engine_switches_set_the_offload_engines_attributes():
    import benchmarks.bench_offload_ab as ab

    engine = type("Engine", (), {"weigh_miss_slots": True})()
    model = type("Model", (), {"offload": engine})()
    assert ab.switches("engine.weigh_miss_slots=0,cpu_threads=4") == {"engine.weigh_miss_slots": 0}
    assert ab.current_switches(model, {"engine.weigh_miss_slots"}) == {"engine.weigh_miss_slots": 1}
    ab.set_switches(model, {"engine.weigh_miss_slots": 0})
    assert engine.weigh_miss_slots == 0
    with pytest.raises(SystemExit, match="engine.no_such: the offload engine has no such switch"):
        ab.set_switches(model, {"engine.no_such": 1})


def test_policy_switches_set_the_placement_policys_numbers():
    """policy.NAME=NUMBER: an attribute of the engine's placement policy, a float where one is given (adaptive
    placement's margin), an int otherwise (its swaps per layer per safe point); what is there now reads back as
    it is."""
    import benchmarks.bench_offload_ab as ab
    from engine.offload.placement import AdaptivePlacement, LayerSlots

    policy = AdaptivePlacement([LayerSlots(8, 2)])
    model = type("Model", (), {"offload": type("Engine", (), {"policy": policy})()})()
    assert ab.switches("placement=adaptive,policy.margin=3.0,policy.max_swaps=1") == {"policy.margin": 3.0,
                                                                                    "policy.max_swaps": 1}
    assert ab.variant("placement=static,policy.margin=3.0") == {"placement": "static"}
    assert ab.current_switches(model, {"policy.margin", "policy.max_swaps"}) == {"policy.margin": 1.5,
                                                                                 "policy.max_swaps": 2}
    ab.set_switches(model, {"policy.margin": 3.0, "policy.max_swaps": 1})
    assert policy.margin == 3.0 and policy.max_swaps == 1
    with pytest.raises(SystemExit, match="policy.margin=wide: a policy switch takes a number"):
        ab.switches("policy.margin=wide")
    with pytest.raises(SystemExit, match="gpu.driver_copies=0.5: a switch takes an integer"):
        ab.switches("gpu.driver_copies=0.5")
    with pytest.raises(SystemExit, match="policy.no_such: the placement policy has no such switch"):
        ab.set_switches(model, {"policy.no_such": 1})


def test_judge_switches_set_adaptive_placements_swap_judge():
    """judge.NAME=NUMBER: an attribute of adaptive placement's swap judge (e.g. the net hits a swap must earn);
    under a placement without a judge (static) there is nothing to set or read, so an A/B across placements runs."""
    import benchmarks.bench_offload_ab as ab
    from engine.offload.placement import LayerSlots, make_policy

    adaptive = make_policy("adaptive", [LayerSlots(8, 2)])
    model = type("Model", (), {"offload": type("Engine", (), {"policy": adaptive})()})()
    assert ab.switches("judge.pays=3.0,judge.window=8") == {"judge.pays": 3.0, "judge.window": 8}
    assert ab.current_switches(model, {"judge.pays", "judge.window"}) == {"judge.pays": 1.0, "judge.window": 16}
    ab.set_switches(model, {"judge.pays": 3.0})
    assert adaptive.judge.pays == 3.0
    with pytest.raises(SystemExit, match="judge.pays=lots: a judge switch takes a number"):
        ab.switches("judge.pays=lots")
    with pytest.raises(SystemExit, match="judge.no_such: the swap judge has no such switch"):
        ab.set_switches(model, {"judge.no_such": 1})
    model.offload.policy = make_policy("static", [LayerSlots(8, 2)])
    assert ab.current_switches(model, {"judge.pays"}) == {}
    ab.set_switches(model, {"judge.pays": 3.0})


def test_slots_switches_set_every_nodes_device_slots():
    import benchmarks.bench_offload_ab as ab

    stores = [type("Slots", (), {"split_on_dense": True})() for _ in range(2)]
    model = type("Model", (), {"offload": type("Engine", (), {"stores": [stores[0], None, stores[1]]})()})()
    assert ab.switches("slots.split_on_dense=0,path=both") == {"slots.split_on_dense": 0}
    assert ab.current_switches(model, {"slots.split_on_dense"}) == {"slots.split_on_dense": 1}
    ab.set_switches(model, {"slots.split_on_dense": 0})
    assert [store.split_on_dense for store in stores] == [0, 0]
    with pytest.raises(SystemExit, match="slots.no_such: CudaSlots has no such switch"):
        ab.set_switches(model, {"slots.no_such": 1})


def test_a_variants_layer_split_is_read_apart():
    from benchmarks.bench_offload_ab import layer_split

    assert variant("split=whole,cpu_threads=3") == {"cpu_threads": 3}
    assert layer_split("split=whole,cpu_threads=3") == "whole"
    assert layer_split("cpu_threads=3") == "spread" and layer_split("") == "spread"
    assert layer_split("split=auto") == "auto"
    with pytest.raises(SystemExit, match="split=layers: one of auto, spread, whole"):
        layer_split("split=layers")


def test_a_variants_decode_path_is_read_apart_and_defaults_to_the_engines(monkeypatch):
    from benchmarks.bench_offload_ab import decode_path

    assert variant("path=tier,cpu_execution=disabled") == {"cpu_execution": "disabled"}
    assert decode_path("path=tier,cpu_execution=disabled") == "tier"
    monkeypatch.setenv("MOE_DECODE_PATH", "auto")
    assert decode_path("cpu_threads=3") == "auto"
    with pytest.raises(SystemExit, match="path=gpu: one of auto, cpu, tier"):
        decode_path("path=gpu")


def test_traced_rounds_route_a_and_b_by_the_same_trace_in_each_round(monkeypatch):
    import benchmarks.bench_offload_ab as ab

    seeds = []

    def traced(model, prompt, tokens, warmup, seed):
        seeds.append((seed, warmup))
        return 50.0

    monkeypatch.setattr(ab, "traced_decode", traced)
    decoder = type("Decoder", (), {"steps": [], "layers_ahead": 0, "layers_beside": 0, "steps_run_again": 0})()
    model = type("Model", (), {"offload": _Engine(), "decoder": decoder})()
    rates = ab.paired_rounds(model, 1 << 20, {"A": {}, "B": {}}, 2, [1], 4, trace=True, warmup=32)
    assert seeds == [(100, 32), (100, 32), (101, 32), (101, 32)] and rates == {"A": [50.0] * 2, "B": [50.0] * 2}


def test_each_rounds_engine_figures_are_those_of_the_timed_decode(tmp_path, monkeypatch):
    """A model at half its experts on the simulated device: each round's figures are the engine's statistics of that
    round's timed steps (reset after the warm-up, as bench_offload's decode does; its timing wrappers, which stay on
    module functions, are left out here), by variant."""
    import benchmarks.bench_offload_ab as ab

    def decode(model, prompt, tokens, warmup=4):
        state = model.new_state()
        token = int(model.decoder.forward(state, prompt)[-1].argmax())
        for _ in range(warmup):
            token = int(model.decoder.forward(state, [token])[-1].argmax())
        model.offload.stats.reset(len(model.offload.slots))
        for _ in range(tokens):
            token = int(model.decoder.forward(state, [token])[-1].argmax())
        return 1.0, []

    monkeypatch.setattr(ab, "decode", decode)
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import all_resident_bytes
    from engine.writer import write_model
    from tests.test_offload import SPEC

    folder = write_model(tmp_path / "m", SPEC)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30))
    budget = all_resident_bytes(model.folder.experts) // 2
    details = {"A": [], "B": []}
    rates = ab.paired_rounds(model, budget, {"A": {}, "B": {"placement": "static"}}, 2, [5, 6, 7], 3, warmup=2,
                             details=details)
    assert len(details["A"]) == len(details["B"]) == 2 and rates == {"A": [1.0, 1.0], "B": [1.0, 1.0]}
    totals = model.offload.stats.totals()  # the last round's (A's: rounds go A B, then B A)
    last = details["A"][-1]
    assert last["hit_rate"] == totals.hit_rate and last["misses_cpu"] == totals.misses_cpu
    assert last["misses_read"] == totals.misses_read == 0  # no host tier on the simulated device
    assert last["layers_ahead"] == last["layers_beside"] == last["steps_run_again"] == 0  # (no "both" layer)
    assert totals.hits + totals.misses == 3 * SPEC.layers * SPEC.top_k  # three timed tokens, every layer's top-k
    assert all(0.0 < r["hit_rate"] < 1.0 and r["whole_layers"] is False for r in details["A"] + details["B"])
    assert all(r["miss_slots"] == 0 for r in details["B"])  # static placement leaves no slot to copies
    # adaptive placement's judge, as copy_state says it (static placement has none)
    assert all(r["placement"] == model.offload.copy_state()["placement"] for r in details["A"][-1:])
    assert all(r["placement"] is None for r in details["B"])
    assert ab.judge_words({"swaps_paused": True, "net_hits_per_swap": 0.046}) == " (paused: 0.05 hits a swap)"
    assert ab.judge_words({"swaps_paused": False, "net_hits_per_swap": 2.314}) == " (2.31 hits a swap)"
    assert ab.judge_words({"swaps_paused": False, "net_hits_per_swap": None}) == ab.judge_words(None) == ""


def test_a_variant_under_trials_is_timed_after_the_first_trial_has_chosen_its_path(monkeypatch):
    """Decode path auto: each reconfiguration starts the trials again, and the warm-up covers the first one (16 steps,
    then 12 with the tier and 4 + 12 with each of the CPU path, both and the tier again) and 20 steps more, so that
    the timed steps run on the path the trial chose, settled, not on the one it measures at that moment."""
    import benchmarks.bench_offload_ab as ab

    decoder = type("Decoder", (), {"steps": [], "layers_ahead": 0, "layers_beside": 0, "steps_run_again": 0})()
    model = type("Model", (), {"offload": _Engine(), "decoder": decoder})()
    warmups = []

    def fake_decode(model, prompt, tokens, warmup=4):
        warmups.append((model.offload.path, warmup))
        return 100.0, []

    monkeypatch.setattr(ab, "decode", fake_decode)
    ab.paired_rounds(model, 1 << 20, {"A": {}, "B": {}}, 2, [1], 4, warmup=32, paths={"A": "auto", "B": "both"})
    assert warmups == [("auto", 16 + 12 + 3 * (4 + 12) + 20), ("both", 32), ("both", 32), ("auto", 96)]


def test_a_split_table_is_read_as_first_or_the_cpus_pairs_per_cold_count():
    import benchmarks.bench_offload_ab as ab

    assert ab.split_table(None) is None and ab.split_table("first") == "first"
    assert ab.split_table("0,0,1,1,2").tolist() == [0, 0, 1, 1, 2]
    with pytest.raises(SystemExit, match="--split-table 0,x: 'first' or the CPU's pairs per cold count"):
        ab.split_table("0,x")


@pytest.mark.parametrize("given", ["0,1,1,2,2", "first", "0,1"])
def test_a_fixed_split_table_holds_in_every_round_of_both_variants(tmp_path, monkeypatch, given):
    """--split-table on the simulated device under "both": every round of A and B decodes with the table given, or
    with the one made from the costs the engine measured in A's warm-up ('first', warmed up again until the rates are
    measured); the engine's own tables come back after the rounds.
    A table whose length is not the layers' k + 1 is refused."""
    import benchmarks.bench_offload_ab as ab
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import all_resident_bytes
    from engine.writer import write_model
    from tests.test_offload import SPEC

    from engine.offload.split_share import RowSplitTrials, SplitShareTrials

    seen, trial_steps = [], []

    def decode(model, prompt, tokens, warmup=4):
        state = model.new_state()
        token = int(model.decoder.forward(state, prompt)[-1].argmax())
        for _ in range(warmup + tokens):
            token = int(model.decoder.forward(state, [token])[-1].argmax())
            seen.append(model.offload.cold_split_table(0).tolist())
        return 1.0, []

    def counted(step):  # a share or row trial's step, by the decode step it came in
        def step_counted(trials, seconds, tokens):
            trial_steps.append(len(seen))
            return step(trials, seconds, tokens)
        return step_counted

    monkeypatch.setattr(ab, "decode", decode)
    monkeypatch.setattr(SplitShareTrials, "step", counted(SplitShareTrials.step))
    monkeypatch.setattr(RowSplitTrials, "step", counted(RowSplitTrials.step))
    folder = write_model(tmp_path / "m", SPEC)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30),
                             decode_path="both")
    budget = all_resident_bytes(model.folder.experts) // 2
    table = ab.split_table(given)
    details = {"A": [], "B": []}
    rounds = lambda: ab.paired_rounds(model, budget, {"A": {}, "B": {"placement": "static"}}, 2,  # noqa: E731
                                      [5, 6, 7], 2, warmup=2, paths={"A": "both", "B": "both"}, table=table,
                                      details=details)
    if given == "0,1":
        with pytest.raises(SystemExit, match=rf"--split-table \[0, 1\]: .* takes {SPEC.top_k} experts a token"):
            rounds()
        return
    rounds()
    # 'first': A's warm-up (2 steps and one token), again until the rates are measured (at most FIRST_MORE_WARMUPS
    # more), its table then the fixed one
    first = len(seen) - 4 * 4
    assert first % 3 == 0 and (3 <= first <= 3 * (1 + ab.FIRST_MORE_WARMUPS) if given == "first" else first == 0)
    fixed = details["tables"]["split"][0][0]  # (no row step within this model's 64 rows: the same as whole pairs')
    assert fixed == (details["tables"]["whole"][0][0] if first else [0, 1, 1, 2, 2])
    assert all(entry == fixed for entry in seen[first:])
    # no share trial ran under the fixed tables (nor row trial): none switched a table beneath the timed steps, and the
    # records say the tables were fixed, with no trials' shift in force
    assert all(step < first for step in trial_steps)
    records = details["A"] + details["B"]
    assert all(r["cold_split"]["fixed"] and r["cold_split"]["share"] is None and r["cold_split"]["rows"] is None
               and r["cold_split"]["cpu_takes"] == fixed and r["fixed_tables"] == "split" for r in records)
    assert model.offload.fixed_split_tables is None  # the engine's own tables again


def test_a_fixed_split_table_refuses_a_variant_where_both_is_not_in_force(tmp_path, monkeypatch):
    """Path "both" asked for under cpu_execution=disabled decodes on the tier (the CPU computes no expert): B's rounds
    would time no fixed table, yet record that they ran one; the A/B is refused instead, in B's first round, and the
    engine has its own tables back."""
    import benchmarks.bench_offload_ab as ab
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import all_resident_bytes
    from engine.writer import write_model
    from tests.test_offload import SPEC

    decoded = []
    monkeypatch.setattr(ab, "decode", lambda model, *args, **kwargs: (decoded.append(1), (1.0, []))[1])
    model = LoadedModel.open(write_model(tmp_path / "m", SPEC), offload=OffloadConfig(device_expert_bytes=0),
                             device=SimulatedDevice(1 << 30), decode_path="both")
    with pytest.raises(SystemExit) as refused:
        ab.paired_rounds(model, all_resident_bytes(model.folder.experts) // 2,
                         {"A": {}, "B": {"cpu_execution": "disabled"}}, 2, [5, 6, 7], 2, warmup=2,
                         paths={"A": "both", "B": "both"}, table=ab.split_table("0,1,1,2,2"))
    assert str(refused.value) == '--split-table: variant B decodes on the path tier, not "both", where the fixed ' \
        'tables hold'
    assert len(decoded) == 1  # A's first round alone
    assert model.offload.fixed_split_tables is None


def test_a_fixed_split_table_times_a_fraction_with_every_expert_resident_without_a_table(tmp_path, monkeypatch):
    """At a fraction that makes every expert resident no expert is cold, so no decode path runs (no tier is made) in
    either variant: the check that "both" is in force stopped the whole A/B there, after the smaller fractions' rounds,
    whose results went unwritten. Those rounds run, and say they decoded under no fixed table; the table given is not
    recorded as fixed there, as it never ran."""
    import benchmarks.bench_offload_ab as ab
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import all_resident_bytes
    from engine.writer import write_model
    from tests.test_offload import SPEC

    monkeypatch.setattr(ab, "decode", lambda model, *args, **kwargs: (1.0, []))
    model = LoadedModel.open(write_model(tmp_path / "m", SPEC), offload=OffloadConfig(device_expert_bytes=0),
                             device=SimulatedDevice(1 << 30), decode_path="both")
    details = {"A": [], "B": []}
    rates = ab.paired_rounds(model, all_resident_bytes(model.folder.experts), {"A": {}, "B": {"placement": "static"}},
                             2, [5, 6, 7], 2, warmup=2, paths={"A": "both", "B": "both"},
                             table=ab.split_table("0,1,1,2,2"), details=details)
    assert rates == {"A": [1.0, 1.0], "B": [1.0, 1.0]}
    assert [r["fixed_tables"] for r in details["A"] + details["B"]] == [None] * 4
    assert details["tables"] == {"split": None, "whole": None, "costs_us": None, "not_fixed": ab.NOT_FIXED}
    assert model.offload.fixed_split_tables is None


def split_model(tmp_path, monkeypatch, observe):
    """A two-layer model whose pairs can be split by rows (256 intermediate rows), on the simulated device under
    "both", with bench_offload_ab's decode replaced by greedy steps that call `observe(engine)` after each."""
    import benchmarks.bench_offload_ab as ab
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.writer import WriterSpec, write_model

    spec = WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=128, inter_size=256, seed=5,
                      dense_accuracy_level=0)

    def decode(model, prompt, tokens, warmup=4):
        state = model.new_state()
        token = int(model.decoder.forward(state, prompt)[-1].argmax())
        for _ in range(warmup + tokens):
            token = int(model.decoder.forward(state, [token])[-1].argmax())
            observe(model.offload)
        return 1.0, []

    monkeypatch.setattr(ab, "decode", decode)
    return LoadedModel.open(write_model(tmp_path / "m", spec), offload=OffloadConfig(device_expert_bytes=0),
                            device=SimulatedDevice(1 << 30), decode_path="both")


def test_first_split_tables_split_a_pair_for_the_split_variant_and_keep_pairs_whole_for_the_other(tmp_path,
                                                                                              monkeypatch):
    """--split-table first with B's engine.row_split=0: both tables come from the same costs (here fixed: the CPU and
    the GPU each 100 µs an expert, no cost a call), A's share and rows (kernels/cold_split.py: split_tables, the CPU
    reading FC2 whole or in part as its kernel does) in every A round, the whole-pair table and no rows in every B
    round; the engine's own methods come back after the rounds."""
    import benchmarks.bench_offload_ab as ab
    from engine.offload.planner import all_resident_bytes
    from kernels.cold_split import split_tables

    seen = {"A": [], "B": []}

    def observe(engine):
        rows = engine.cold_split_rows(0)
        seen["A" if engine.row_split else "B"].append(
            (engine.cold_split_table(0).tolist(), None if rows is None else rows.tolist()))

    model = split_model(tmp_path, monkeypatch, observe)
    engine = model.offload
    assert engine.stores[0].splits_rows
    monkeypatch.setattr(engine, "_split_costs", lambda layer: (100e-6, 0.0, 100e-6))
    details = {"A": [], "B": []}
    ab.paired_rounds(model, all_resident_bytes(model.folder.experts) // 4, {"A": {}, "B": {}}, 2, [5, 6, 7], 2,
                     variant_switches={"A": {}, "B": {"engine.row_split": 0}}, warmup=2, details=details,
                     paths={"A": "both", "B": "both"}, table="first")
    in_part = engine.runners[0].kernel.reads_rows_in_part
    share, rows = split_tables(4, 256, 64, 100e-6, 0.0, 100e-6, 0.0, 2 / 3, cpu_reads_fc2_whole=not in_part)
    assert rows.any()  # a pair is split where the two sides cost the same
    assert details["tables"] == {"split": [[share.tolist(), rows.tolist()]] * 2,
                                 "whole": [[[0, 0, 1, 1, 2], None]] * 2,
                                 "costs_us": [[pytest.approx(100.0), 0.0, pytest.approx(100.0), 0.0]] * 2}
    assert seen["B"] and set(map(str, seen["B"])) == {str(([0, 0, 1, 1, 2], None))}
    rounds = seen["A"][-2 * 4:]  # (before them, A's warm-ups for the tables, under the engine's own)
    assert set(map(str, rounds)) == {str((share.tolist(), rows.tolist()))}
    assert engine.fixed_split_tables is None
    assert [r["fixed_tables"] for r in details["A"] + details["B"]] == ["split"] * 2 + ["whole"] * 2


def run_ab(tmp_path, monkeypatch, *argv) -> dict:
    """bench_offload_ab's main with `argv` on SPEC's model on the simulated device, opened under "both", its decode
    greedy steps (no timing): the result file's config."""
    import json

    import benchmarks.bench_offload_ab as ab
    import benchmarks.common as common
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.writer import write_model
    from tests.test_offload import SPEC

    def decode(model, prompt, tokens, warmup=4):
        state = model.new_state()
        token = int(model.decoder.forward(state, prompt)[-1].argmax())
        for _ in range(warmup + tokens):
            token = int(model.decoder.forward(state, [token])[-1].argmax())
        return 1.0, []

    def opened(*args):
        model = LoadedModel.open(write_model(tmp_path / "m", SPEC), offload=OffloadConfig(device_expert_bytes=0),
                                 device=SimulatedDevice(1 << 30), decode_path="both")
        return model, [5, 6, 7]

    monkeypatch.setattr(ab, "decode", decode)
    monkeypatch.setattr(ab, "open_model", opened)
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    ab.main(["--device", "simulated", "--fractions", "0.5", *argv])
    return json.loads(next((tmp_path / "results").glob("offload-ab-*.json")).read_text())["config"]


def test_the_ab_writes_and_prints_which_fixed_tables_ran_with_no_trials_shift(tmp_path, monkeypatch, capsys):
    """bench_offload_ab --split-table on the simulated device under "both": the result file and the printed lines say
    that the tables were fixed, which ran in each round and what they are; none reports a share trial's shift (the
    trials' shift, here pinned at -1 as a trial could leave it, is not what the fixed tables run)."""
    from engine.offload.split_share import SplitShareTrials

    monkeypatch.setattr(SplitShareTrials, "shift", property(lambda trials: -1))  # as a trial could leave it
    config = run_ab(tmp_path, monkeypatch, "--a", "path=both", "--b", "path=both,placement=static", "--rounds", "2",
                    "--decode-tokens", "2", "--decode-warmup", "2", "--split-table", "0,1,1,2,2")
    printed = capsys.readouterr().out
    assert "shift" not in printed
    assert printed.count('CPU takes [0, 1, 1, 2, 2] of c cold in layers 0-2 (fixed tables "split"') == 2  # A's, B's
    assert "tables fixed, layers 0-2: the CPU's pairs [0, 1, 1, 2, 2], a pair split at rows None; whole pairs " \
        "[0, 1, 1, 2, 2]\n" in printed
    result = config["per_fraction"]["0.50"]
    assert result["split_tables"] == {"split": [[[0, 1, 1, 2, 2], None]] * 3, "whole": [[[0, 1, 1, 2, 2], None]] * 3,
                                      "costs_us": None}
    for record in result["a_rounds"] + result["b_rounds"]:
        assert record["fixed_tables"] == "split"
        assert {key: record["cold_split"][key] for key in ("fixed", "cpu_takes", "split_rows", "share", "rows")} == {
            "fixed": True, "cpu_takes": [0, 1, 1, 2, 2], "split_rows": None, "share": None, "rows": None}


def test_under_a_split_table_a_variant_naming_no_path_decodes_under_both_and_one_naming_another_is_refused(
        tmp_path, monkeypatch):
    """The fixed tables hold only under "both": under --split-table a variant naming no path decodes every round under
    "both" (not MOE_DECODE_PATH's auto, whose path trials its rounds would time, under the tables only while a trial
    had "both" in force), and one naming another path is refused, before the model is opened."""
    import benchmarks.bench_offload_ab as ab

    monkeypatch.setenv("MOE_DECODE_PATH", "auto")
    config = run_ab(tmp_path, monkeypatch, "--b", "placement=static", "--rounds", "2", "--decode-tokens", "2",
                    "--decode-warmup", "2", "--split-table", "0,1,1,2,2")
    assert (config["a_path"], config["b_path"]) == ("both", "both")
    records = config["per_fraction"]["0.50"]["a_rounds"] + config["per_fraction"]["0.50"]["b_rounds"]
    assert [(r["decode_path"], r["path"]["mode"], r["cold_split"]["cpu_takes"]) for r in records] == [
        ("both", "both", [0, 1, 1, 2, 2])] * 4
    assert ab.decode_path("placement=static") == "auto"  # (without --split-table, the engine's default still)

    def not_opened(*args):
        raise AssertionError("the model was opened")

    monkeypatch.setattr(ab, "open_model", not_opened)
    for path in ("auto", "tier", "cpu"):
        with pytest.raises(SystemExit) as refused:
            ab.main(["--device", "simulated", "--a", "path=both", "--b", f"cpu_threads=3,path={path}",
                     "--split-table", "first"])
        assert str(refused.value) == (f"--split-table: variant B names path={path}, but the fixed tables hold only "
                                      f"under \"both\" (name path=both or no path)")


def test_first_split_tables_are_each_layers_own(tmp_path, monkeypatch):
    """--split-table first on a model whose layers cost differently (here the CPU's expert 100 µs in layer 0 and
    300 µs in layer 1, the GPU's 100 µs in both): each layer decodes every round under the tables its own costs make,
    not layer 0's, and the tables written and printed are each layer's."""
    import benchmarks.bench_offload_ab as ab
    from benchmarks.bench_offload import layer_words
    from engine.offload.planner import all_resident_bytes
    from kernels.cold_split import split_tables

    seen = []

    def observe(engine):
        rows = [engine.cold_split_rows(layer) for layer in (0, 1)]
        seen.append([(engine.cold_split_table(layer).tolist(), None if made is None else made.tolist())
                     for layer, made in enumerate(rows)])

    model = split_model(tmp_path, monkeypatch, observe)
    engine = model.offload
    monkeypatch.setattr(engine, "_split_costs", lambda layer: ((1 + 2 * layer) * 100e-6, 0.0, 100e-6))
    details = {"A": [], "B": []}
    ab.paired_rounds(model, all_resident_bytes(model.folder.experts) // 4, {"A": {}, "B": {}}, 2, [5, 6, 7], 2,
                     warmup=2, details=details, paths={"A": "both", "B": "both"}, table="first")
    in_part = engine.runners[0].kernel.reads_rows_in_part
    made = [split_tables(4, 256, 64, cpu_s, 0.0, 100e-6, 0.0, 2 / 3, cpu_reads_fc2_whole=not in_part)
            for cpu_s in (100e-6, 300e-6)]
    made = [(share.tolist(), rows.tolist()) for share, rows in made]
    assert made[0] != made[1]  # the layers' tables differ
    assert set(map(str, seen[-4 * 4:])) == {str(made)}  # every round's steps, each layer under its own
    assert details["tables"]["split"] == [list(pair) for pair in made]
    assert [costs[0] for costs in details["tables"]["costs_us"]] == [pytest.approx(100.0), pytest.approx(300.0)]
    lines = ab.tables_lines(details["tables"])
    assert [line.split(":")[0] for line in lines] == ["tables fixed, layer 0", "tables fixed, layer 1"]
    assert f"the CPU's pairs {made[1][0]}, a pair split at rows {made[1][1]}" in lines[1]
    # each round's figures and its printed line give every layer's table, not layer 0's alone
    assert all(r["cold_split"]["tables"] == [{"layers": [layer], "cpu_takes": share, "split_rows": rows,
                                              "inter_size": 256} for layer, (share, rows) in enumerate(made)]
               for r in details["A"])
    words = ab.split_words(details["A"][-1]["cold_split"], "split")
    assert words.startswith(f", CPU takes {made[0][0]} of c cold in layer 0 and {made[1][0]} in layer 1 (fixed "
                            f"tables \"split\"")  # (then slow steps the CPU's rate left out, where any)
    assert f"), a pair split at rows {made[0][1]} in layer 0 and {made[1][1]} in layer 1, host " in words
    assert layer_words([0, 1, 2, 3, 5, 8, 9]) == "layers 0-3, 5, 8-9" and layer_words([4]) == "layer 4"


def test_a_fraction_that_fails_leaves_the_earlier_fractions_written_with_what_failed(tmp_path, monkeypatch, capsys):
    """A later fraction refused (as a real card without room for the tier's mappings refuses it): the result file was
    written only at the end, so the earlier fractions' rounds were lost with it. They are written, with the fraction
    that failed and why, and the failure still ends the run."""
    import json

    from engine.offload.engine import OffloadEngine
    from engine.offload.planner import OffloadPlanError

    budgets, real = [], OffloadEngine.reconfigure

    def refusing(engine, config, *args, **kwargs):
        if config.device_expert_bytes and config.device_expert_bytes not in budgets:  # (0: as opened)
            budgets.append(config.device_expert_bytes)
        if len(budgets) == 2:  # the second fraction's
            raise OffloadPlanError("no room on the device for the host tier's mappings")
        return real(engine, config, *args, **kwargs)

    monkeypatch.setattr(OffloadEngine, "reconfigure", refusing)
    with pytest.raises(OffloadPlanError, match="no room on the device"):
        run_ab(tmp_path, monkeypatch, "--b", "placement=static", "--rounds", "2", "--decode-tokens", "2",
               "--decode-warmup", "2", "--fractions", "0.25,0.75")
    assert "  75%  failed: OffloadPlanError: no room on the device for the host tier's mappings\n" in \
        capsys.readouterr().out
    written = json.loads(next((tmp_path / "results").glob("offload-ab-*.json")).read_text())
    assert list(written["config"]["per_fraction"]) == ["0.25"]
    assert len(written["config"]["per_fraction"]["0.25"]["a_rounds"]) == 2
    assert [figure["name"] for figure in written["figures"]] == ["decode B / A at 25% resident"]
    assert written["failed"] == {"fraction": "0.75",
                                 "error": "OffloadPlanError: no room on the device for the host tier's mappings"}


def test_first_split_tables_wait_for_no_rates_where_every_expert_is_resident(tmp_path, monkeypatch):
    """--split-table first at a fraction with every expert resident: no step has a cold pair, so neither the CPU's
    parts nor the GPU's reads of the tier are ever measured, and fix_split_table ran its FIRST_MORE_WARMUPS warm-ups
    waiting for them, then recorded tables made from the start-up guesses, which no round ran. It makes no tables, so
    runs no warm-up for them, and records none, saying why; below that fraction it still waits."""
    import benchmarks.bench_offload_ab as ab
    from engine.offload.planner import all_resident_bytes

    model = split_model(tmp_path, monkeypatch, lambda engine: None)
    greedy, decoded = ab.decode, []
    monkeypatch.setattr(ab, "decode", lambda *args, **kwargs: (decoded.append(1), greedy(*args, **kwargs))[1])
    every = all_resident_bytes(model.folder.experts)
    details = {"A": [], "B": []}
    ab.paired_rounds(model, every, {"A": {}, "B": {}}, 2, [5, 6, 7], 2, warmup=2, details=details,
                     paths={"A": "both", "B": "both"}, table="first")
    assert len(decoded) == 2 * 2  # 2 rounds of A and B
    assert [r["fixed_tables"] for r in details["A"] + details["B"]] == [None] * 4
    assert details["tables"] == {"split": None, "whole": None, "costs_us": None, "not_fixed": ab.NOT_FIXED}
    assert ab.tables_lines(details["tables"]) == [
        "no tables fixed: every expert is resident, so no decode step has a cold pair for a table to split"]
    decoded.clear()
    ab.paired_rounds(model, every // 4, {"A": {}, "B": {}}, 2, [5, 6, 7], 2, warmup=2,
                     paths={"A": "both", "B": "both"}, table="first")
    assert model.offload.split_rate.value is not None and model.offload.tier_read.value is not None
    assert len(decoded) > 1 + 2 * 2  # (a warm-up more, at least, until both rates are measured)


def test_the_ab_at_every_expert_resident_writes_and_prints_no_first_tables(tmp_path, monkeypatch, capsys):
    """bench_offload_ab --split-table first at 100% resident: the result file and the printed lines kept the tables
    made from the engine's start-up guesses, which no round ran. The file's fraction holds none and says why, and so
    does the printed line."""
    config = run_ab(tmp_path, monkeypatch, "--b", "placement=static", "--rounds", "2", "--decode-tokens", "2",
                    "--decode-warmup", "2", "--split-table", "first", "--fractions", "1.0")
    printed = capsys.readouterr().out
    assert "tables fixed, layer" not in printed
    assert "       no tables fixed: every expert is resident, so no decode step has a cold pair for a table to " \
        "split\n" in printed
    assert config["per_fraction"]["1.00"]["split_tables"] == {
        "split": None, "whole": None, "costs_us": None,
        "not_fixed": "every expert is resident, so no decode step has a cold pair for a table to split"}


def test_the_ab_prints_its_engine_figures_as_the_last_rounds(tmp_path, monkeypatch, capsys):
    """Under each fraction's medians, a line of engine figures a variant: they are its last round's (the hit rate and
    misses of its timed decode, the counts of layers and steps with its warm-up), not the fraction's, and the line
    read "A: hit 0.41, ..." beside the medians of every round; it says so."""
    from engine.units import counted

    config = run_ab(tmp_path, monkeypatch, "--b", "placement=static", "--rounds", "2", "--decode-tokens", "2",
                    "--decode-warmup", "2")
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    result = config["per_fraction"]["0.50"]
    for name, rounds in (("A", result["a_rounds"]), ("B", result["b_rounds"])):
        last = rounds[-1]
        [line] = [line for line in lines if line.startswith(f"{name} ")]
        assert line.startswith(f"{name} in its last round: hit {last['hit_rate']:.2f}, misses cpu/copied/read "
                               f"{last['misses_cpu']}/{last['misses_copied']}/{last['misses_read']}, ")
        assert line.endswith(f", {counted(last['layers_ahead'], 'layer')} launched ahead, {last['layers_beside']} on "
                             f"the worker, {counted(last['steps_run_again'], 'step')} run again (warm-up included)")


def test_the_ab_at_every_expert_resident_says_no_decode_path_ran(tmp_path, monkeypatch, capsys):
    """At 100% resident no expert is cold, so no decode path runs; the rounds' records and printed lines gave the path
    in force, "decode path cpu (no host tier)", which reads as decoding on the CPU. They say "all resident", as the
    engine's run records do, and that no decode path ran; below that fraction the path in force still."""
    from engine.records.schema import ALL_RESIDENT

    config = run_ab(tmp_path, monkeypatch, "--a", "path=both", "--b", "placement=static,path=both", "--rounds", "2",
                    "--decode-tokens", "2", "--decode-warmup", "2", "--fractions", "0.5,1.0")
    printed = capsys.readouterr().out
    every, half = config["per_fraction"]["1.00"], config["per_fraction"]["0.50"]
    assert [(r["decode_path"], r["path"]["in_force"]) for r in every["a_rounds"] + every["b_rounds"]] == [
        (ALL_RESIDENT, ALL_RESIDENT)] * 4
    assert [r["decode_path"] for r in half["a_rounds"] + half["b_rounds"]] == ["both"] * 4
    assert printed.count(", spread, every expert resident: no decode path ran, 0 layers launched ahead") == 2
    assert printed.count(", spread, decode path both, CPU takes ") == 2
    assert "decode path cpu" not in printed


def test_first_tables_line_gives_each_cost_its_unit_and_what_it_is():
    """The printed line of 'first''s tables gave the CPU's cost a call without its unit ("+ 0 a call") and the host's
    gap as "the host's 0 µs", which says not what the host spends it on; the line names both as split_words does."""
    import benchmarks.bench_offload_ab as ab

    fixed = {"split": [[[0, 0, 1], [0, 64, 0]]] * 2, "whole": [[[0, 0, 1], None]] * 2,
             "costs_us": [[1183.2, 4.4, 118.6, 35.1]] * 2}
    assert ab.tables_lines(fixed) == [
        "tables fixed, layers 0-1: the CPU's pairs [0, 0, 1], a pair split at rows [0, 64, 0]; whole pairs [0, 0, 1] "
        "(from the CPU's 1183 µs an expert + 4 µs a call, the GPU's 119 µs an expert, the host's 35 µs between "
        "layers)"]


def test_the_abs_help_gives_every_option_a_text_and_every_item_a_variant_takes(monkeypatch, capsys):
    """--a and --b named only offload entries, not the switches, split= or path= a variant takes, and --rounds,
    --decode-tokens, --shape, --device and --dtype had no text at all. Every option's help says what it is; --a's
    names every switch prefix and dense switch, each layer split and each decode path (from the lists that check
    them), and --b's refers to it."""
    import re

    import benchmarks.bench_offload_ab as ab
    from engine.offload.decode_path import MODES as PATH_MODES
    from engine.offload.layer_split import MODES as SPLIT_MODES

    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exited:
        ab.main(["--help"])
    assert exited.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    helps = {}  # option -> its help text, its lines joined
    for entry in re.split(r"\n(?=  -)", options.strip("\n")):
        invocation, _, text = entry.strip().partition("  ")  # the help starts after two spaces or on the next line
        helps[invocation.split()[0].rstrip(",")] = " ".join(text.split())
    assert set(helps) == {"-h", "--shape", "--device", "--dtype", "--layers", "--folder", "--fractions", "--a", "--b",
                          "--rounds", "--decode-tokens", "--decode-warmup", "--trace", "--split-table", "--no-write"}
    assert all(helps.values()), [option for option, text in helps.items() if not text]
    assert helps["--rounds"].startswith("rounds at each fraction, A then B in even rounds and B then A in odd ones")
    assert helps["--decode-tokens"] == "decode steps timed for each variant in a round"
    said = helps["--a"]
    for prefix in ab.SWITCH_PREFIXES:
        assert f"{prefix}NAME=" in said or prefix == "dense.", prefix
    for name in ab.DENSE_SWITCHES:
        assert f"{name}=0|1" in said
    assert "policy.NAME=NUMBER" in said and "judge.NAME=NUMBER" in said and "gpu.NAME=INT" in said
    assert f"split={'|'.join(SPLIT_MODES)} (default spread)" in said
    assert f"path={'|'.join(PATH_MODES)} (default MOE_DECODE_PATH" in said
    assert helps["--b"] == "configuration B, its items as --a's"


def test_the_abs_lines_count_one_round_layer_and_step_in_the_singular(tmp_path, monkeypatch, capsys):
    """The medians' line said "1 rounds" and a variant's last-round line "1 layers launched ahead", "1 steps run
    again": one of each is singular, more plural."""
    import benchmarks.bench_offload_ab as ab

    run_ab(tmp_path, monkeypatch, "--b", "placement=static", "--rounds", "1", "--decode-tokens", "2",
           "--decode-warmup", "2")
    assert ", 1 round)\n" in capsys.readouterr().out
    last = {"hit_rate": 0.5, "misses_cpu": 1, "misses_copied": 0, "misses_read": 0, "miss_copies": 0, "swaps": 0,
            "miss_slots": 0, "whole_layers": False, "path": {"in_force": "cpu", "host_tier": True}, "cold_split": None,
            "fixed_tables": None, "cpu_rate": None, "layers_ahead": 1, "layers_beside": 1, "steps_run_again": 1}
    assert ab.last_round_line("A", last) == (
        "A in its last round: hit 0.50, misses cpu/copied/read 1/0/0, copies 0, swaps 0, miss slots 0, spread, decode "
        "path cpu, 1 layer launched ahead, 1 on the worker, 1 step run again (warm-up included)")
    last.update(layers_ahead=2, steps_run_again=0)
    assert ab.last_round_line("B", last).endswith(
        ", 2 layers launched ahead, 1 on the worker, 0 steps run again (warm-up included)")


def test_a_variants_last_round_says_the_cpu_rate_in_force_with_the_measured_one_beside_it(tmp_path):
    """engine_figures gave the CPU kernels' rate as measured, where the miss policy and the split's tables price a CPU
    miss at the rate clamped to the host's streaming read (cpu_bytes_per_s): the rate in force is said, and the
    measured one beside it where the stream clamped it."""
    import benchmarks.bench_offload_ab as ab
    from engine.writer import write_model
    from tests.test_offload import SPEC, clamped_rates_model

    figures = ab.engine_figures(clamped_rates_model(write_model(tmp_path / "m", SPEC)))  # 60 GB/s measured, 40 read
    assert (figures["cpu_rate"], figures["cpu_measured_rate"]) == (pytest.approx(40e9), pytest.approx(60e9))
    assert figures["cpu_measured_fixed_s"] == pytest.approx(100e-6)
    assert ab.cpu_rate_words(figures) == \
        ", CPU kernels 40 GB/s + 6 µs a call (measured 60 GB/s + 100 µs a call, its rate clamped to the stream)"
    assert ab.cpu_rate_words({**figures, "cpu_measured_rate": 40e9}) == ", CPU kernels 40 GB/s + 6 µs a call"
