"""Static placement without a popularity file (engine/offload/placement.py's StaticPlacement): its opening counts what
routing chooses, then the layer's most counted experts are copied into its slots at safe points and never move."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generation import LoadedModel
from engine.offload.placement import OPENING_PAIRS_PER_EXPERT, LayerSlots, StaticPlacement, make_policy
from tests.test_offload import SPEC, assert_same_as_cpu, greedy_run
from tests.test_offload_misses import FAST_PCIE, model_folder, open_model, slot_bytes  # noqa: F401 (fixtures)


def top(counts: np.ndarray, slots: int) -> set[int]:
    """The `slots` most counted experts, counted at least once, the lowest id first on ties."""
    best = np.argsort(-counts, kind="stable")[:slots]
    return set(best[counts[best] > 0].tolist())


def with_the_files(counts: np.ndarray, file: list[int], slots: int) -> set[int]:
    """A layer's choice topped up by its opening: the experts the popularity file counts, then the `slots` left's most
    counted of the others (top)."""
    counts = counts.copy()
    counts[file] = 0
    return top(counts, slots - len(file)) | set(file)


def test_without_a_file_the_openings_hottest_experts_are_placed_once_and_never_move():
    """Skewed routing (a hot set per layer takes most of it) with the miss policy copying misses into spare slots:
    static placement without a popularity file placed nothing of its own, so its slots only churned with copies. Now,
    once a layer's opening has counted OPENING_PAIRS_PER_EXPERT pairs per expert, its most counted experts go in,
    within the safe points' swap limit, and stay: no further swap, and no slot is spare for copies any more."""
    rng = np.random.default_rng(3)
    experts, k, slots, count = 32, 4, 8, 3
    layers = [LayerSlots(experts, slots) for _ in range(count)]
    policy = make_policy("static", layers)
    hot = [rng.choice(experts, 6, replace=False) for _ in range(count)]
    opening_steps = OPENING_PAIRS_PER_EXPERT * experts // k  # k pairs a step in every layer
    seen = np.zeros((count, experts))
    history = []
    for step in range(200):
        for index, layer in enumerate(layers):
            ids = rng.choice(hot[index] if rng.random() < 0.8 else np.arange(experts), k, replace=False)
            spare = policy.spare_slots(index, ids)  # the miss policy: a routed cold expert copied into a spare slot
            cold = [int(e) for e in ids if layer.slot_of[e] < 0]
            for slot, expert in zip(spare.tolist(), cold[:1]):
                policy.admit(index, slot, expert)
            policy.observe(index, ids)
            if step < opening_steps:
                np.add.at(seen[index], ids, 1)
        swaps = policy.rebalance(1)  # one copy a safe point: the fill takes a few steps
        assert (step + 1 < opening_steps) == policy.opening
        history.append(([set(layer.resident().tolist()) for layer in layers], swaps))
    expected = [top(seen[index], slots) for index in range(count)]
    assert [set(layer.resident().tolist()) for layer in layers] == expected
    assert all(set(hot[index].tolist()) <= expected[index] for index in range(count))  # the skew shows
    settled = next(step for step, (resident, _) in enumerate(history) if resident == expected)
    assert settled < opening_steps + slots * count  # one copy a safe point
    assert all(resident == expected and not swaps for resident, swaps in history[settled + 1:])
    assert all(policy.spare_slots(index, np.zeros(0, np.int64)).size == 0 for index in range(count))
    assert not any(policy.admitted[index][layer.resident()].any() for index, layer in enumerate(layers))


def test_with_a_popularity_file_the_residents_come_from_it_at_once():
    layers = [LayerSlots(8, 3)]
    policy = StaticPlacement(layers, [np.array([0, 5, 0, 9, 0, 0, 1, 0], float)])
    assert [(swap.slot, swap.loaded) for swap in policy.initial()] == [(0, 3), (1, 1), (2, 6)]
    assert not policy.opening
    for _ in range(3 * OPENING_PAIRS_PER_EXPERT):  # routing that disagrees with the file moves nothing
        policy.observe(0, np.array([0, 2, 4, 5]))
        assert policy.rebalance() == []
    assert sorted(layers[0].resident().tolist()) == [1, 3, 6]


@pytest.mark.parametrize("prompt", ["The expert offload engine must be exact, " * 2, "Hi"])
def test_on_the_device_the_measured_hottest_experts_end_resident_and_outputs_stay_exact(model_folder, slot_bytes,
                                                                                       prompt):
    """On the simulated device, with copies always paying (every slot spare during the opening): the opening ends at
    the safe point where each layer has counted its pairs (a long prompt's prefill, or a short prompt's decode steps),
    the experts that routing chose most by then (the engine's own per-expert counts) end resident and stay so, and
    the tokens and logits are the all-CPU run's."""
    steps = 48
    model, _device = open_model(model_folder, FAST_PCIE, placement="static",
                                device_expert_bytes=8 * SPEC.layers * slot_bytes)  # 8 of 16 experts per layer
    engine = model.offload
    policy, stats = engine.policy, engine.stats
    end_step, seen = model.decoder.on_step_end, []

    def recording(step_s, tokens):
        end_step(step_s, tokens)
        seen.append(([hits + misses for hits, misses in zip(stats.expert_hits, stats.expert_misses)],
                     policy.opening, [set(layer.resident().tolist()) for layer in engine.slots]))

    model.decoder.on_step_end = recording
    run = greedy_run(model, prompt, steps)
    chose = next(index for index, (_counts, opening, _resident) in enumerate(seen) if not opening)
    counts = seen[chose][0]
    assert all(c.sum() >= OPENING_PAIRS_PER_EXPERT * SPEC.num_experts for c in counts)
    assert chose == 0 or all(c.sum() < OPENING_PAIRS_PER_EXPERT * SPEC.num_experts for c in seen[chose - 1][0])
    assert (chose == 0) == (prompt != "Hi")
    expected = [top(c, 8) for c in counts]
    assert seen[-1][2] == expected
    assert all(resident == expected for _c, _o, resident in seen[-10:])  # placed, and never moved since
    # static placement never moves a resident of its own: its copies over copied misses fill its slots, no swap
    assert sum(layer.fills for layer in stats.layers) >= 1 and sum(layer.swaps for layer in stats.layers) == 0
    assert stats.totals().miss_copies > 0
    assert_same_as_cpu(run, greedy_run(LoadedModel.open(model_folder), prompt, steps))


LONG_PROMPT = "The expert offload engine must be exact, " * 2  # its prefill ends the opening


def resident_sets(engine) -> list[set[int]]:
    return [set(layer.resident().tolist()) for layer in engine.slots]


def routed_counts(engine) -> list[np.ndarray]:
    """The engine's own per-expert routing counts (OffloadStats), per layer."""
    return [hits + misses for hits, misses in zip(engine.stats.expert_hits, engine.stats.expert_misses)]


def test_a_budget_change_keeps_the_measured_counts_and_places_the_best_for_the_new_slots(model_folder, slot_bytes):
    """A re-plan (here, a larger budget) under static placement without a popularity file made a fresh policy: the
    counts measured so far were lost, the residents kept became its own for good, and the new slots only churned with
    copies (a new opening, with the old choice frozen in). Now the counts are kept, and the layers choose for their new
    slot count at once: the best-counted experts, as many as there are slots."""
    model, _device = open_model(model_folder, FAST_PCIE, placement="static",
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    greedy_run(model, LONG_PROMPT, 0)
    opening = routed_counts(engine)
    greedy_run(model, "Hi", 4)  # (copied in within the swap allowance)
    assert not engine.policy.opening and resident_sets(engine) == [top(c, 4) for c in opening]
    engine.reconfigure(engine.config.updated(device_expert_bytes=8 * SPEC.layers * slot_bytes))
    counts = routed_counts(engine)
    assert [layer.num_slots for layer in engine.slots] == [8] * SPEC.layers
    assert not engine.policy.opening and resident_sets(engine) == [top(c, 8) for c in counts]
    greedy_run(model, "Hi", 4)
    assert resident_sets(engine) == [top(c, 8) for c in counts]  # chosen once: they stay


def test_static_placement_set_on_a_model_loaded_adaptive_measures_before_keeping_any_resident(model_folder,
                                                                                              slot_bytes):
    """placement=static applied (without a popularity file) on a model loaded under adaptive placement took the
    residents adaptive placement had at that moment as its own, for good. Now they are only copies to it: its opening
    measures routing, then its own choice replaces them."""
    model, _device = open_model(model_folder, FAST_PCIE, placement="adaptive",
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    greedy_run(model, "Hi", 4)
    engine = model.offload
    engine.reconfigure(engine.config.updated(placement="static"))
    policy = engine.policy
    assert policy.opening
    for index, layer in enumerate(engine.slots):  # spare for copied misses, every one
        assert layer.resident().size and policy.admitted[index][layer.resident()].all()
    engine.stats.reset(len(engine.slots))
    greedy_run(model, LONG_PROMPT, 0)
    opening = routed_counts(engine)
    greedy_run(model, "Hi", 4)
    assert not policy.opening and resident_sets(engine) == [top(c, 4) for c in opening]


def test_residents_a_failed_replan_dropped_are_copied_in_again():
    """Slots made fewer, then as many again, keep each layer's first residents (LayerSlots.resize): the chosen experts
    dropped go back in at the next safe point."""
    layers = [LayerSlots(8, 4)]
    policy = StaticPlacement(layers)
    for _ in range(OPENING_PAIRS_PER_EXPERT * 2):
        policy.observe(0, np.array([1, 2, 3, 4]))
    assert len(policy.rebalance()) == 4 and policy.rebalance() == []
    layers[0].resize(2)
    layers[0].resize(4)
    assert [(swap.slot, swap.loaded) for swap in policy.rebalance()] == [(2, 3), (3, 4)]
    assert sorted(layers[0].resident().tolist()) == [1, 2, 3, 4]


def test_the_engine_says_how_long_the_opening_counts_and_what_is_left_to_copy_in(model_folder, slot_bytes):
    """copy_state's static_placement (records, --json and the placement view): the tokens the opening still counts
    (8 pairs for each of 16 experts, 4 a token), then the chosen experts not yet in; None under adaptive placement."""
    model, _device = open_model(model_folder, FAST_PCIE, placement="static",
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    assert engine.copy_state()["static_placement"] == {"opening_tokens_left": 32, "to_place": 0,
                                                       "unchosen_slots": [0] * SPEC.layers}
    greedy_run(model, "Hi", 4)
    state = model.offload.stats_dict()["static_placement"]
    assert state["opening_tokens_left"] == 32 - len(model.tokenizer.encode("Hi")) - 4 and state["to_place"] == 0
    greedy_run(model, LONG_PROMPT, 0)
    assert engine.copy_state()["static_placement"] == {"opening_tokens_left": 0, "to_place": engine.policy.to_place(),
                                                       "unchosen_slots": [0] * SPEC.layers}
    greedy_run(model, "Hi", 4)
    assert engine.copy_state()["static_placement"] == {"opening_tokens_left": 0, "to_place": 0,
                                                       "unchosen_slots": [0] * SPEC.layers}
    engine.reconfigure(engine.config.updated(placement="adaptive"))
    assert engine.copy_state()["static_placement"] is None


def test_layers_with_nothing_to_choose_have_no_opening(model_folder, slot_bytes):
    """A layer without slots, or with a slot for every expert (node_overrides, or a budget that holds every expert),
    has nothing to choose: the opening's tokens were still said of it, so a fully resident model's view said static
    placement would count routing for 32 more tokens before placing the residents it already had."""
    from engine.offload import OffloadConfig, SimulatedDevice

    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    overrides = f"{names[0]}:max_resident_slots=16;{names[1]}:max_resident_slots=3;{names[2]}:max_resident_slots=0"
    config = OffloadConfig.from_entries({"session.moe.offload.placement": "static",
                                         "session.moe.offload.node_overrides": overrides})
    model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    engine = model.offload
    assert [layer.num_slots for layer in engine.slots] == [16, 3, 0]
    assert engine.copy_state()["static_placement"] == {"opening_tokens_left": 32, "to_place": 0,  # the middle layer's
                                                       "unchosen_slots": [0, 0, 0]}
    greedy_run(model, LONG_PROMPT, 0)
    opening = routed_counts(engine)
    greedy_run(model, "Hi", 4)
    assert resident_sets(engine) == [set(range(16)), top(opening[1], 3), set()]
    model = LoadedModel.open(model_folder, offload=OffloadConfig(placement="static", device_expert_bytes=None),
                             device=SimulatedDevice(1 << 30))
    assert model.offload.plan.placement_mode == "all_resident"
    assert model.offload.copy_state()["static_placement"] == {"opening_tokens_left": 0, "to_place": 0,
                                                              "unchosen_slots": [0] * SPEC.layers}
    assert not model.offload.policy.opening


def test_adaptive_placement_set_after_static_starts_from_its_counts_scaled_as_a_popularity_files(model_folder,
                                                                                               slot_bytes):
    """placement=adaptive applied after static placement took static's raw counts as its scores: after a long run,
    hundreds, where an expert routed at every step scores ~10 under adaptive's decay, so its residents outweighed
    what routing did next for dozens of steps. They start scaled as a popularity file's counts are (the most counted
    1.0 in each layer), keeping the ranking."""
    model, _device = open_model(model_folder, FAST_PCIE, placement="static",
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    greedy_run(model, LONG_PROMPT * 3, 8)
    engine = model.offload
    counts = routed_counts(engine)
    assert max(c.max() for c in counts) > 10
    engine.reconfigure(engine.config.updated(placement="adaptive"))
    for scores, c in zip(engine.policy.scores, counts):
        assert np.allclose(scores, c / c.max())


def test_a_popularity_file_with_uncounted_experts_still_fills_a_layer_with_a_slot_for_every_expert(model_folder,
                                                                                                  tmp_path):
    """Static placement chooses only experts counted at least once, leaving the other slots to copied misses; but
    where a layer has a slot for every expert, each one is resident, as at a load with every expert on the device:
    the layer then routes on the device (all_resident), with no miss."""
    import json

    from engine.offload import OffloadConfig, SimulatedDevice

    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({name: [5] * 4 + [0] * 12 for name in names}))
    model = LoadedModel.open(model_folder, offload=OffloadConfig(placement="static", popularity_file=str(path),
                                                                 device_expert_bytes=None),
                             device=SimulatedDevice(1 << 30))
    assert model.offload.plan.placement_mode == "all_resident"
    assert all(layer.all_resident for layer in model.offload.slots)
    greedy_run(model, "Hi", 2)
    assert model.offload.stats.totals().misses == 0


def test_a_popularity_file_taken_off_the_loaded_model_leaves_static_placement_to_measure(model_folder, slot_bytes,
                                                                                         tmp_path):
    """popularity_file cleared on a model loaded with one under static placement: the counts carried over the
    re-plan were the file's (plus the routing since), so its experts were chosen again as though it were still
    set. Now static placement measures, as a load without a file does: its opening's routing alone chooses."""
    import json

    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({name: [0] * 12 + [1000] * 4 for name in names}))
    model, _device = open_model(model_folder, FAST_PCIE, placement="static", popularity_file=str(path),
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    assert resident_sets(engine) == [{12, 13, 14, 15}] * SPEC.layers
    engine.reconfigure(engine.config.updated(popularity_file=None))
    assert engine.policy.opening
    engine.stats.reset(len(engine.slots))
    greedy_run(model, LONG_PROMPT, 0)
    opening = routed_counts(engine)
    greedy_run(model, "Hi", 4)
    assert resident_sets(engine) == [top(c, 4) for c in opening] != [{12, 13, 14, 15}] * SPEC.layers


def test_a_node_the_popularity_file_leaves_out_is_measured_by_the_opening(model_folder, slot_bytes, tmp_path):
    """A popularity file that names only some expert nodes counted the others as uniform: their residents were experts
    0..S-1 for good, whatever routing did. Now those nodes are measured by static placement's opening, as without a
    file, while the nodes the file names take its residents at once; the plan says which is which."""
    import json

    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({names[0]: [0] * 12 + [1000] * 4}))
    model, _device = open_model(model_folder, FAST_PCIE, placement="static", popularity_file=str(path),
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    assert resident_sets(engine)[0] == {12, 13, 14, 15}
    assert all(not layer.resident().size for layer in engine.slots[1:])  # nothing chosen yet: the opening measures
    assert engine.policy.opening and engine.copy_state()["static_placement"]["opening_tokens_left"] == 32
    statement = next(s for s in engine.plan.statements if "popularity.json" in s)
    assert statement == (f"{path} counts 1 of {SPEC.layers} expert nodes ('{names[0]}'); static placement measures "
                         f"the other 2 over its opening ('{names[1]}', '{names[2]}').")
    greedy_run(model, LONG_PROMPT, 0)
    opening = routed_counts(engine)
    greedy_run(model, "Hi", 4)
    assert not engine.policy.opening
    assert resident_sets(engine) == [{12, 13, 14, 15}] + [top(c, 4) for c in opening[1:]]
    assert resident_sets(engine)[1:] != [{0, 1, 2, 3}] * (SPEC.layers - 1)
    engine.reconfigure(engine.config.updated(device_expert_bytes=8 * SPEC.layers * slot_bytes))  # a budget change
    counts = routed_counts(engine)
    # the file's, as at the load, topped up at once from the routing its layer measured (the file counts 4 of 8)
    assert resident_sets(engine)[0] == with_the_files(counts[0], [12, 13, 14, 15], 8)
    assert resident_sets(engine)[1:] == [top(c, 8) for c in counts[1:]]  # the measured counts kept, chosen anew


def _placed(model_folder, slot_bytes):
    """A model under static placement, 4 slots a layer, past its opening (a long prompt) with its choice copied in (4
    decode steps): (the model, its resident sets)."""
    model, _device = open_model(model_folder, FAST_PCIE, placement="static",
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    greedy_run(model, LONG_PROMPT, 0)
    greedy_run(model, "Hi", 4)
    return model, resident_sets(model.offload)


def test_a_replan_that_keeps_a_layers_slots_keeps_its_chosen_residents(model_folder, slot_bytes):
    """Static placement's residents never move once chosen; but any re-plan (an Apply of another setting, the same
    budgets) made a new policy whose layers chose again at once from every count since the load, so routing after the
    opening moved residents as adaptive placement would. A layer whose slot count the re-plan keeps keeps its choice;
    one whose slots changed chooses for them from the counts (test_a_budget_change_keeps_the_measured_counts...)."""
    model, placed = _placed(model_folder, slot_bytes)
    engine = model.offload
    assert not engine.policy.opening and engine.policy.to_place() == 0
    for index, layer in enumerate(engine.slots):  # routing since then favours experts it did not choose
        others = np.array(sorted(set(range(SPEC.num_experts)) - placed[index]))
        for _ in range(50):
            engine.policy.observe(index, others[:4])
    engine.reconfigure(engine.config.updated(cpu_threads=1))
    assert resident_sets(engine) == placed
    greedy_run(model, "Hi", 4)
    assert resident_sets(engine) == placed


def test_a_popularity_file_set_later_leaves_the_layers_it_leaves_out_as_measured(model_folder, slot_bytes, tmp_path):
    """A popularity file naming one node, set on a model whose static placement had measured its opening: every
    layer's slots were emptied and its counts dropped, so the layers the file leaves out measured a new opening with
    empty slots. Those layers now keep their counts and their residents; the file's layer takes the file's."""
    import json

    model, placed = _placed(model_folder, slot_bytes)
    engine = model.offload
    names = [info.name for info in engine.infos]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({names[0]: [0] * 12 + [1000] * 4}))
    engine.reconfigure(engine.config.updated(popularity_file=str(path)))
    assert not engine.policy.opening
    assert resident_sets(engine) == [{12, 13, 14, 15}] + placed[1:]


def test_records_and_json_say_which_slots_static_placement_leaves_to_copies():
    """copy_state (records, --json) said adaptive placement's miss slots ([0, 0, 0] under static placement) and nothing
    of the slots static placement leaves to copied misses where its choice counts fewer experts than a layer has
    slots: a record's hit rate read as static placement's own. static_placement's unchosen_slots says them per layer
    (none before a layer has chosen; while its opening tops a popularity file's choice up, those the file leaves)."""
    layers = [LayerSlots(16, 4), LayerSlots(16, 4)]
    policy = StaticPlacement(layers, [np.array([0] * 15 + [3], float), None])
    policy.initial()
    assert [policy.unchosen_slots(index) for index in range(2)] == [3, 0] and policy.opening
    for _ in range(OPENING_PAIRS_PER_EXPERT * 16 // 4):  # routing that keeps to two experts of each layer (k = 4)
        for index in range(2):
            policy.observe(index, np.array([3, 5, 3, 5]))
    policy.rebalance()
    assert not policy.opening
    assert [sorted(layer.resident().tolist()) for layer in layers] == [[3, 5, 15], [3, 5]]
    assert [policy.unchosen_slots(index) for index in range(2)] == [1, 2]


def test_a_popularity_file_that_counts_fewer_experts_than_slots_is_topped_up_by_the_opening(model_folder, slot_bytes,
                                                                                            tmp_path):
    """A popularity file counting fewer experts of a node than the layer has slots (the rest 0: routed nowhere in its
    measurement) left the other slots to copied misses for good: static placement never chose for them, and the plan
    said nothing. Now the layer's opening measures routing as in a layer the file leaves out, and its most routed
    experts fill the slots left (the file's stay); the plan says which nodes; the outputs stay the all-CPU run's."""
    import json

    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({names[0]: [0] * 15 + [3], names[1]: [0] * 14 + [5, 9], names[2]: [1] * 16}))
    model, _device = open_model(model_folder, FAST_PCIE, placement="static", popularity_file=str(path),
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    assert resident_sets(engine) == [{15}, {14, 15}, {0, 1, 2, 3}]
    # the slots the file's counts leave hold copied misses until the opening chooses for them
    assert engine.copy_state()["static_placement"] == {"opening_tokens_left": 32, "to_place": 0,
                                                       "unchosen_slots": [3, 2, 0]}
    statement = next(s for s in engine.plan.statements if "popularity.json" in s)
    assert statement == (f"{path} counts fewer experts than the layer has slots in 2 expert nodes ('{names[0]}', "
                         f"'{names[1]}'): static placement places the counted ones at once and fills the slots left "
                         "with the experts its opening measures routed most.")
    greedy_run(model, LONG_PROMPT, 0)  # its prefill ends the opening
    opening = routed_counts(engine)
    run = greedy_run(model, "Hi", 4)
    assert not engine.policy.opening

    def others(counts, file):  # the opening's best of the experts the file counts 0
        counts = counts.copy()
        counts[file] = 0
        return top(counts, 4 - len(file)) | set(file)

    assert resident_sets(engine) == [others(opening[0], [15]), others(opening[1], [14, 15]), {0, 1, 2, 3}]
    assert engine.copy_state()["static_placement"] == {"opening_tokens_left": 0, "to_place": 0,
                                                       "unchosen_slots": [0, 0, 0]}
    assert_same_as_cpu(run, greedy_run(LoadedModel.open(model_folder), "Hi", 4))
    placed = resident_sets(engine)
    engine.reconfigure(engine.config.updated(cpu_threads=1))  # a re-plan keeping the slots keeps them all
    assert resident_sets(engine) == placed and not engine.policy.opening and engine.policy.to_place() == 0


def test_a_budget_change_keeps_what_a_topped_up_layers_opening_measured(model_folder, slot_bytes, tmp_path):
    """A popularity file counting fewer experts of a node than the layer has slots, its opening topping the file's
    choice up: a re-plan that changed the layer's slot count (a budget change) made its opening start again from
    nothing, though the routing it had counted still held (mid-opening: 32 tokens again; past it: a new opening, the
    residents it had chosen left as copies). Now the counts are kept: an opening under way goes on where it was, and
    one that is over chooses for the new slots at once (the file's experts, then the routing's best of the others)."""
    import json

    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({names[0]: [0] * 15 + [3]}))
    model, _device = open_model(model_folder, FAST_PCIE, placement="static", popularity_file=str(path),
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    greedy_run(model, "Hi", 4)
    left = engine.copy_state()["static_placement"]["opening_tokens_left"]
    assert 0 < left < 32
    engine.reconfigure(engine.config.updated(device_expert_bytes=6 * SPEC.layers * slot_bytes))
    assert [layer.num_slots for layer in engine.slots] == [6] * SPEC.layers
    assert engine.copy_state()["static_placement"]["opening_tokens_left"] == left
    assert np.flatnonzero(engine.policy.chosen[0]).tolist() == [15] and engine.policy.topping_up[0]
    greedy_run(model, LONG_PROMPT, 0)  # its prefill ends the opening
    counts = routed_counts(engine)
    greedy_run(model, "Hi", 4)
    assert not engine.policy.opening and resident_sets(engine)[0] == with_the_files(counts[0], [15], 6)
    engine.reconfigure(engine.config.updated(device_expert_bytes=8 * SPEC.layers * slot_bytes))  # past the opening
    counts = routed_counts(engine)
    assert not engine.policy.opening and engine.policy.to_place() == 0
    assert resident_sets(engine)[0] == with_the_files(counts[0], [15], 8)


def test_the_settle_progress_says_static_placement_is_what_it_waits_for(model_folder, slot_bytes):
    """A sweep point's or a comparison's settle waits for static placement's opening and copies too
    (OffloadEngine.trials_pending), and its progress line said 'decoding until the engine's trials of its ways are
    over' meanwhile: it says which (pending_words)."""
    model, _device = open_model(model_folder, FAST_PCIE, placement="static",
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    assert engine.trials_pending and engine.pending_words() == "static placement has counted its opening's routing"
    greedy_run(model, LONG_PROMPT, 0)  # the opening ends at the prompt: its choice still to copy in
    assert engine.policy.to_place() and engine.pending_words() == "static placement's residents are copied in"
    adaptive, _device = open_model(model_folder, FAST_PCIE, device_expert_bytes=4 * SPEC.layers * slot_bytes)
    assert adaptive.offload.pending_words() == "the engine's trials of its ways are over"


def test_a_node_the_popularity_file_counts_0_throughout_is_measured_by_the_opening(model_folder, slot_bytes,
                                                                                  tmp_path):
    """A node whose counts in the popularity file are all 0 (routed nowhere in the file's measurement: it tells no
    expert from another) was taken as counted: static placement chose none of its experts and left every slot of the
    layer to copied misses for good, the plan saying nothing. Now it is measured by the opening as a node the file
    leaves out, the plan naming it; the outputs stay the all-CPU run's."""
    import json

    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({names[0]: [0] * 12 + [1000] * 4, names[1]: [0] * SPEC.num_experts}))
    model, _device = open_model(model_folder, FAST_PCIE, placement="static", popularity_file=str(path),
                                device_expert_bytes=4 * SPEC.layers * slot_bytes)
    engine = model.offload
    assert resident_sets(engine) == [{12, 13, 14, 15}, set(), set()]
    assert engine.copy_state()["static_placement"] == {"opening_tokens_left": 32, "to_place": 0,
                                                       "unchosen_slots": [0, 0, 0]}
    statement = next(s for s in engine.plan.statements if "popularity.json" in s)
    assert statement == (f"{path} counts 1 of {SPEC.layers} expert nodes ('{names[0]}'); static placement measures "
                         f"the other 2 over its opening (left out: '{names[2]}'; 0 for every expert: '{names[1]}').")
    greedy_run(model, LONG_PROMPT, 0)  # its prefill ends the opening
    opening = routed_counts(engine)
    run = greedy_run(model, "Hi", 4)
    assert resident_sets(engine) == [{12, 13, 14, 15}] + [top(c, 4) for c in opening[1:]]
    assert engine.copy_state()["static_placement"]["unchosen_slots"] == [0, 0, 0]
    assert_same_as_cpu(run, greedy_run(LoadedModel.open(model_folder), "Hi", 4))


def test_a_popularity_file_set_later_with_a_node_counted_0_throughout_leaves_that_layer_as_measured(
        model_folder, slot_bytes, tmp_path):
    """A file set on a model past its opening empties the layers it counts and places the file's residents there; a
    node the file counts 0 throughout was emptied too (its slots then left to copies). It keeps what it measured."""
    import json

    model, placed = _placed(model_folder, slot_bytes)
    engine = model.offload
    names = [info.name for info in engine.infos]
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({names[0]: [0] * 12 + [1000] * 4, names[1]: [0] * SPEC.num_experts}))
    engine.reconfigure(engine.config.updated(popularity_file=str(path)))
    assert not engine.policy.opening
    assert resident_sets(engine) == [{12, 13, 14, 15}] + placed[1:]
