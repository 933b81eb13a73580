"""Readable views of run records: one run in detail, two runs compared metric by metric (HTML for
the history view's dialogs; plain values for tests and copying)."""

from __future__ import annotations

import html
from pathlib import Path

from engine.records.environment import cuda_version_text
from engine.records.scenarios import device_parts_text
from engine.records.schema import RunRecord, decode_path_run, fallback_reason
from engine.sampling import SamplingParams, describe
from engine.units import byte_rate, counted, duration_text, human_bytes

NOT_RECORDED = "not recorded"

THREADS_METRIC = "CPU expert threads at the end"  # compared; a run's detail says it with its cores instead
PROCESS_VRAM, PINNED = "this process's VRAM peak (NVML)", "pinned host memory"

# (label, how to get it from a record, format, lower is better)
METRICS = (
    ("load", lambda r: r.timings.get("load_s"), "s", True),
    ("first token", lambda r: r.timings.get("time_to_first_token_s"), "s", True),
    ("prefill", lambda r: r.timings.get("prefill_s"), "s", True),
    ("decode", lambda r: r.timings.get("decode_tokens_per_s"), "tok/s", False),
    ("completion", lambda r: r.timings.get("completion_s"), "s", True),
    # on a simulated device: what the simulated card would give (engine/offload/projection.py)
    ("projected decode", lambda r: (r.timings.get("projected") or {}).get("decode_tokens_per_s"), "tok/s", False),
    ("projected completion", lambda r: (r.timings.get("projected") or {}).get("completion_s"), "s", True),
    ("generated tokens", lambda r: r.generated_tokens, "n", None),
    ("device memory peak", lambda r: r.peaks.get("device_bytes"), "bytes", True),
    # on a CUDA GPU: the engine's device memory above, and onnxruntime's arena and the CUDA context besides it
    (PROCESS_VRAM, lambda r: r.peaks.get("process_device_bytes"), "bytes", True),
    # the staging ring and host tier (held from load or re-plan on)
    (PINNED, lambda r: r.peaks.get("pinned_bytes"), "bytes", True),
    ("process RSS peak", lambda r: r.peaks.get("rss_bytes"), "bytes", True),
    # what the process held already when the run began (a model loaded earlier, an earlier run's memory kept)
    ("process RSS at the start", lambda r: r.peaks.get("rss_start_bytes"), "bytes", True),
    ("bytes copied to the device", lambda r: r.bytes_moved, "bytes", True),
    ("expert hit rate", lambda r: hit_rate(r), "%", False),
    # what else used the CPUs during the run (a run beside other work, or on a busy virtual machine's host)
    ("CPU time other processes took", lambda r: r.host_load.get("host_others_share"), "%", True),
    ("CPU time the VM's host took (steal)", lambda r: r.host_load.get("host_steal_share"), "%", True),
    # (automatic: fewer where other processes kept cores busy, engine/kernel_threads.py)
    (THREADS_METRIC, lambda r: (r.offload.get("cpu_threads") or {}).get("cpu_threads_in_force"), "n", None),
)


def sampling_text(record: RunRecord) -> str | None:
    """'greedy', or the sampling settings and seed; None where the record predates them."""
    g = record.generation
    if not g:
        return None
    params = SamplingParams(do_sample=g["do_sample"], temperature=g["temperature"], top_k=g["top_k"], top_p=g["top_p"],
                            repetition_penalty=g["repetition_penalty"])
    seed = f", seed {g['seed']}" if g["do_sample"] and g.get("seed") is not None else ""
    return describe(params) + seed


def _stop_texts(record: RunRecord) -> str | None:
    return None if not record.generation else " | ".join(record.generation.get("stop_strings") or []) or "none"


def _reasoning_setting(record: RunRecord) -> str | None:
    return None if not record.generation else record.generation.get("reasoning") or "the template's default"


def _length_limit(record: RunRecord) -> str | None:
    limit = record.generation.get("max_new_tokens")
    return None if limit is None else f"{counted(limit, 'token')} an answer"


# how the answers were asked for, as a record keeps it (RunRecord.generation): (what, get)
GENERATION_FACTS = (
    ("answer length limit", _length_limit),
    ("sampling", sampling_text),
    ("stop texts", _stop_texts),
    ("reasoning setting", _reasoning_setting),
)


def hit_rate(record: RunRecord) -> float | None:
    hits = sum(layer.get("hits", 0) for layer in record.layers)
    misses = sum(layer.get("misses", 0) for layer in record.layers)
    return hits / (hits + misses) if hits + misses else None


def fmt(value, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "s":
        return duration_text(value)
    if unit == "tok/s":
        return f"{value:.1f} tok/s"
    if unit == "bytes":
        return human_bytes(int(value))
    if unit == "%":
        return f"{value:.1%}"
    return str(value)


def compare_rows(a: RunRecord, b: RunRecord) -> list[tuple[str, str, str, str, str]]:
    """(metric, A, B, B − A, B / A) for every key metric."""
    rows = []
    for label, get, unit, _lower in METRICS:
        x, y = get(a), get(b)
        if x is None and y is None:
            continue
        diff = ratio = "—"
        if x is not None and y is not None:
            delta = y - x
            # two shares differ by percentage points (beside the ratio, "+10.0%" would read as a relative change)
            size = f"{abs(delta) * 100:.1f} points" if unit == "%" else fmt(abs(delta), unit)
            diff = ("+" if delta > 0 else "−" if delta < 0 else "±") + size
            # none against an A shown as zero: a quiet run's share of the CPUs' time is a float's rounding (2e-10)
            ratio = f"{y / x:.2f}×" if x and fmt(x, unit) != fmt(0, unit) else "—"
        rows.append((label, fmt(x, unit), fmt(y, unit), diff, ratio))
    return rows


def title(record: RunRecord, run_id: int | None = None) -> str:
    name = Path(str(record.model.get("folder", "?"))).name
    label = f" “{record.label}”" if record.label else ""
    number = f"run {run_id}: " if run_id is not None else ""
    return f"{number}{record.scenario}{label} · {name} · {record.created}"


def _table(rows, header=None) -> str:
    out = ["<table cellspacing='0' cellpadding='3' border='1' style='border-collapse:collapse'>"]
    if header:
        out.append("<tr>" + "".join(f"<th align='left'>{html.escape(str(h))}</th>" for h in header) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c)).replace(chr(10), '<br>')}</td>" for c in row) + "</tr>")
    return "".join(out) + "</table>"


# the offload plan's placement_mode (engine/offload/planner.py), in words
EXPERTS_WHERE = {"hybrid": "hybrid: resident ones on the device, the others on the CPU",
                 "all_resident": "every one resident on the device", "cpu_only": "every one on the CPU"}


def _approximation_text(record: RunRecord) -> str:
    """'120 / 0 of 240 (k per token in each layer)': approximate routing's drops and substitutions among the run's
    routed experts (those left after it, which the layers count as hits and misses, and the dropped ones)."""
    dropped, substituted = record.approximation["dropped"], record.approximation["substituted"]
    routed = sum(layer.get("hits", 0) + layer.get("misses", 0) for layer in record.layers) + dropped
    return f"{dropped} / {substituted} of {routed} (k per token in each layer)"


# the versions besides the app's, onnxruntime's and Python's that a run's numbers depend on: the CPU expert kernels are
# Numba's, the GPU's run through CuPy on the CUDA runtime and driver (absent where none was found): (what, key)
VERSIONS = (("NumPy", "numpy"), ("Numba", "numba"), ("CuPy", "cupy"), ("CUDA runtime", "cuda_runtime"),
            ("CUDA driver", "cuda_driver"))


def _version(record: RunRecord, key: str) -> str | None:
    """A VERSIONS entry of the record; CUDA's as CUDA names them (12.8, not the 12080 it gives)."""
    value = (record.versions or {}).get(key)
    return cuda_version_text(value) if key.startswith("cuda_") else value


def detail_html(record: RunRecord, run_id: int | None = None) -> str:
    t, o = record.timings, record.offload
    parts = [f"<h3>{html.escape(title(record, run_id))}</h3>"]
    parts.append(_table([
        ("model", record.model.get("folder", "")), ("type", record.model.get("type", "")),
        ("device", o.get("device", "cpu")),
        *([("why on the CPU", o["device_fallback"])] if o.get("device_fallback") else []),
        ("experts", EXPERTS_WHERE.get(o.get("placement_mode"), "every one on the CPU")),
        ("placement", (o.get("entries") or {}).get("session.moe.offload.placement", "adaptive")
         if o.get("placement_mode") == "hybrid" else "—"),
        *([("popularity file SHA-256", o["popularity_sha256"])] if o.get("popularity_sha256") else []),
        ("dense part", _dense(record) or NOT_RECORDED),
        *([("decode path", path)] if (path := _decode_path(record)) else []),
        ("CPU expert kernels", _threads(record) or NOT_RECORDED),
        ("approximate routing", "on" if record.approximate_routing else "off")]
        + ([("token agreement with exact routing", f"{record.routing_agreement:.1%}")]
           if record.routing_agreement is not None else [])
        + ([("routed experts dropped / substituted", _approximation_text(record))] if record.approximation else [])
        + [(what, get(record) or NOT_RECORDED) for what, get in GENERATION_FACTS]))
    parts.append("<h4>Timings and peaks</h4>")
    metrics = [(label, fmt(get(record), unit)) for label, get, unit, _ in METRICS
               # (a run on the CPU or the simulated card has no projection, VRAM or pinned memory: left out)
               if not ((label.startswith("projected") or label in (PROCESS_VRAM, PINNED)) and get(record) is None)
               and label != THREADS_METRIC]
    if record.peaks.get("other_side_loaded"):  # side by side: one process held both sides' models
        after = next(i for i, (label, _value) in enumerate(metrics) if label == "process RSS at the start") + 1
        metrics.insert(after, ("process peaks hold", "both sides' models: the other side's was loaded in this process "
                                                     "too (side by side)"))
    warm_up = _warm_up(record)
    if warm_up:  # beside the times it was left out of
        after = next(i for i, (label, _value) in enumerate(metrics) if label == "completion") + 1
        metrics.insert(after, ("unrecorded warm-up answer", warm_up))
    held = record.peaks.get("device_parts")  # (absent in records older than it)
    if held:  # beside the peak: the host tier's granule-rounded mappings may be most of it
        after = next(i for i, (label, _value) in enumerate(metrics) if label == "device memory peak") + 1
        metrics.insert(after, ("device peak made of", device_parts_text(held)))
    parts.append(_table(metrics + [("turns", t.get("turns", len(record.turns))),
                                   ("cancelled", "yes" if t.get("cancelled") else "no")]))
    parts.append("<h4>Configuration</h4>")
    entries = o.get("entries") or {}
    parts.append(_table(sorted(entries.items()), ("entry", "value")) if entries
                 else "<p>Defaults (no offload entries set).</p>")
    for statement in o.get("statements") or []:
        parts.append(f"<p>{html.escape(statement)}</p>")
    if record.layers:
        parts.append("<h4>Per layer</h4>")
        rows = []
        nodes = record.model.get("expert_nodes") or []
        for index, layer in enumerate(record.layers):
            name = nodes[index]["node"] if index < len(nodes) else f"layer {index}"
            rate = layer.get("hit_rate")
            rows.append((name, layer.get("hits", 0), layer.get("misses", 0), "—" if rate is None else f"{rate:.1%}",
                         human_bytes(layer.get("copy_bytes", 0)), fmt(layer.get("cpu_s"), "s"),
                         fmt(layer.get("device_s"), "s")))
        hbm = ((t.get("projected") or {}).get("bandwidths") or {}).get("hbm_bytes_per_s")
        parts.append(_table(rows, ("expert node", "hits", "misses", "hit rate", "copied", "CPU time",
                                   "device time (modelled)" if hbm else "device time")))
        if hbm:  # the simulated card's: read as measured, a tiny model's microseconds looked like a broken timer
            parts.append(f"<p>Device time on the simulated card is modelled, not measured: each launch reads its "
                         f"experts once at the card's {byte_rate(hbm, 0)}, summed over the run's launches, with no "
                         "launch overhead.</p>")
    parts.append("<h4>Conversation</h4>")
    for index, turn in enumerate(record.turns, start=1):
        tt = turn.get("timings", {})
        cached = f", +{turn['reused_cache_tokens']} cached" if turn.get("reused_cache_tokens") else ""
        parts.append(f"<p><b>Prompt {index}</b> ({turn.get('prompt_tokens', 0)} tokens{cached}):"
                     f"<br>{_text(turn.get('prompt', ''), 600)}</p>")
        if turn.get("reasoning"):
            parts.append(f"<p><b>Reasoning {index}</b>:<br><i>{_text(turn['reasoning'])}</i></p>")
        parts.append(f"<p><b>Answer {index}</b> ({turn.get('generated_tokens', 0)} tokens, "
                     f"{turn.get('finish_reason', '')}, first token {fmt(tt.get('time_to_first_token_s'), 's')}):"
                     f"<br>{_text(turn.get('answer', ''))}</p>")
    machine = record.machine or {}
    versions = record.versions or {}
    ort = versions.get("onnxruntime") or {}
    parts.append("<h4>Machine and versions</h4>")
    build = f" ({ort['build']})" if ort.get("build") else ""
    parts.append(_table([("CPU", f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores)"),
                         ("RAM", human_bytes(machine.get("ram_bytes") or 0) if machine.get("ram_bytes") else "?"),
                         ("GPU", _gpus(machine)),
                         ("app", versions.get("app", "?")), ("onnxruntime", ort.get("version", "?") + build),
                         ("python", versions.get("python", "?"))]
                        + [(what, _version(record, key)) for what, key in VERSIONS if _version(record, key)]))
    return "".join(parts)


def _warm_up(record: RunRecord) -> str | None:
    """What the record says of the unrecorded answer its run followed, off its clock: a sweep point's at the point's
    budget (point_warm_up_s), else the model's first after its load (warm_up_s, 0 in the runs after it); None in a
    record older than both."""
    said, point = record.timings.get("warm_up_s"), record.timings.get("point_warm_up_s")
    if point is not None:
        return (f"{duration_text(point)}: the sweep point's, at its budget, which every run of the point follows "
                + ("(this run, the point's first, right after it)" if said else "(an earlier run of the point right "
                   "after it)"))
    if said is None:
        return None
    if said:
        return f"{duration_text(said)}: the model's first answer since its load, right before this run"
    return "none right before this run: the model gave it before an earlier run"


def _gpus(machine: dict) -> str:
    """The NVIDIA GPUs NVML found with their memory and driver: none where it found none (or no driver), "?" in a
    record without the list."""
    if "gpus" not in machine:
        return "?"
    return "; ".join(gpu["error"] if "error" in gpu else
                     f"{gpu.get('name', '?')} ({human_bytes(gpu['memory_bytes']) if gpu.get('memory_bytes') else '?'}, "
                     f"driver {gpu.get('driver', '?')})" for gpu in machine["gpus"]) or "none found (NVML)"


def _dense(record: RunRecord) -> str | None:
    dense = record.offload.get("dense")
    if not dense:
        return None
    where = "on the GPU (onnxruntime's CUDA EP)" if dense.get("device") == "cuda" else "on the CPU"
    return where + (f": {dense['reason']}" if dense.get("reason") else "")


def _decode_path(record: RunRecord) -> str | None:
    """'tier (asked: auto)': the path the run's cold experts took, and the one asked for; None on the CPU."""
    path = record.offload.get("decode_path")
    return f"{decode_path_run(record.offload)} (asked: {path.get('mode')})" if path else None


def _threads(record: RunRecord) -> str | None:
    """'1 of 2 threads at the end of the run (cpu_threads automatic: it moved 2 times as other processes' load
    changed)', or of a fixed count."""
    threads = record.offload.get("cpu_threads")
    if not threads:
        return None
    count = f"{threads['cpu_threads_in_force']} of {threads['cores']} threads"
    if not threads["cpu_threads_automatic"]:
        return f"{count} (cpu_threads={threads['cpu_threads_in_force']})"
    moved = threads["cpu_threads_changes"]
    return (f"{count} at the end of the run (cpu_threads automatic: it moved {moved} time{'' if moved == 1 else 's'} "
            "as other processes' load changed)")


def _layer_split(record: RunRecord) -> str | None:
    split = record.offload.get("layer_split")
    return None if not split else "whole layers" if split.get("whole_layers") else "spread over every layer"


def _slots(record: RunRecord) -> str | None:
    """'16 for the 32 experts': the expert slots the plan gave the device (with every expert resident, one an expert;
    adaptive placement may leave some to copied misses), and the model's experts; None on the CPU."""
    slots = record.offload.get("slots")
    if slots is None:
        return None
    experts = sum(node.get("experts") or 0 for node in record.model.get("expert_nodes") or [])
    return f"{sum(slots.values())} for the {experts} experts"


def _machine(record: RunRecord) -> str:
    machine = record.machine or {}
    gpus = ", ".join(gpu.get("name", "?") for gpu in machine.get("gpus") or [])
    return f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores)" + (f", {gpus}" if gpus else "")


def _why_on_the_cpu(record: RunRecord) -> str | None:
    """Why the CUDA GPU a run on the CPU asked for could not be used (its note's reason: the whole note would be cut
    in a comparison's cell); "none recorded" where it chose the CPU (or its record is older than the field); None for
    a run on a device."""
    if record.offload.get("device", "cpu") != "cpu":
        return None
    note = record.offload.get("device_fallback")
    return fallback_reason(note) if note else "none recorded"


# what two runs may differ in besides their offload entries, each of which makes their numbers unlike: (what, get);
# a fact one of them lacks (layer split and decode path on the CPU, where the device already differs) is left out
RUN_FACTS = (
    ("scenario", lambda r: r.scenario),
    ("prompts", lambda r: "\n".join(turn.get("prompt", "") for turn in r.turns)),
    ("model", lambda r: r.model.get("folder")),
    ("model file (model.onnx's SHA-256)", lambda r: r.model.get("onnx_sha256")),
    ("device", lambda r: r.offload.get("device", "cpu")),
    # two runs on the CPU, one of which asked for a CUDA GPU it could not have: the device alone reads alike
    ("why on the CPU", _why_on_the_cpu),
    # (the same entries, an automatic budget, hold fewer where the device had less free: side-by-side's B beside A;
    # other entries give other slots: FROM_ENTRIES)
    ("expert slots on the device", _slots),
    ("popularity file (SHA-256)", lambda r: r.offload.get("popularity_sha256")),
    ("dense part", lambda r: (r.offload.get("dense") or {}).get("device")),
    ("layer split", _layer_split),
    ("decode path asked", lambda r: (r.offload.get("decode_path") or {}).get("mode")),
    # (the automatic path's trials may end on different paths for the same settings)
    ("decode path in force", lambda r: decode_path_run(r.offload) if r.offload.get("decode_path") else None),
    *GENERATION_FACTS,
    ("tokens generated", lambda r: r.generated_tokens if r.turns else None),
    ("machine", _machine),
    ("GPU driver", lambda r: ", ".join(gpu.get("driver", "?") for gpu in (r.machine or {}).get("gpus") or []) or None),
    ("app", lambda r: (r.versions or {}).get("app")),
    ("onnxruntime", lambda r: ((r.versions or {}).get("onnxruntime") or {}).get("version")),
    ("onnxruntime build", lambda r: ((r.versions or {}).get("onnxruntime") or {}).get("build")),
    *((what, lambda r, key=key: _version(r, key)) for what, key in VERSIONS if key != "numpy"),
)


# the facts of RUN_FACTS that follow from the offload entries: a difference of their own only under the same entries
FROM_ENTRIES = ("expert slots on the device",)


def entry_differences(a: RunRecord, b: RunRecord) -> list[tuple[str, str, str]]:
    """(entry, A, B) for every offload entry the two runs were given differently ('default' where one has none)."""
    ea, eb = a.offload.get("entries") or {}, b.offload.get("entries") or {}
    return [(key, ea.get(key, "default"), eb.get(key, "default")) for key in sorted(set(ea) | set(eb))
            if ea.get(key) != eb.get(key)]


def run_differences(a: RunRecord, b: RunRecord) -> list[tuple[str, str, str]]:
    """(what, A, B) for every fact of RUN_FACTS the two runs differ in besides their offload entries and what those
    decide: a comparison of them is not like for like."""
    rows = []
    same_entries = not entry_differences(a, b)
    for what, get in RUN_FACTS:
        if what in FROM_ENTRIES and not same_entries:
            continue
        x, y = get(a), get(b)
        if x is not None and y is not None and x != y:
            rows.append((what, _text(str(x), 160, raw=True), _text(str(y), 160, raw=True)))
    return rows


def compare_html(a: RunRecord, b: RunRecord, ids: tuple[int, int] | None = None) -> str:
    ids = ids or (None, None)
    parts = [f"<p><b>A</b> {html.escape(title(a, ids[0]))}<br><b>B</b> {html.escape(title(b, ids[1]))}</p>"]
    unlike = run_differences(a, b)
    if unlike:
        parts.append("<p><b>Not like for like:</b> besides their offload entries these runs differ in "
                     f"{html.escape(', '.join(what for what, _x, _y in unlike))}, so their numbers differ for those "
                     "reasons too.</p>" + _table(unlike, ("", "A", "B")))
    older = [name for name, record in (("A", a), ("B", b)) if not record.generation]
    if older:
        what = ", ".join(what for what, _get in GENERATION_FACTS)
        parts.append(f"<p>Not recorded in run{'s' if len(older) > 1 else ''} {' and '.join(older)} (a record older "
                     f"than them): {what}; whether the two runs asked for the same answers cannot be told.</p>")
    parts.append(_table(compare_rows(a, b), ("metric", "A", "B", "B − A", "B / A")))
    changed = entry_differences(a, b)
    parts.append("<h4>Configuration differences</h4>")
    parts.append(_table(changed, ("entry", "A", "B")) if changed else "<p>Same offload entries.</p>")
    for index, (ta, tb) in enumerate(zip(a.turns, b.turns), start=1):
        if ta.get("reasoning") or tb.get("reasoning"):
            reasoning = [(_text(ta.get("reasoning", ""), raw=True), _text(tb.get("reasoning", ""), raw=True))]
            parts.append(f"<h4>Reasoning {index}</h4>" + _table(reasoning, ("A", "B")))
        parts.append(f"<h4>Answer {index}</h4>" + _table([(_text(ta.get("answer", ""), raw=True),
                                                            _text(tb.get("answer", ""), raw=True))], ("A", "B")))
    return "".join(parts)


def _text(text: str, limit: int | None = None, raw: bool = False) -> str:
    if limit and len(text) > limit:
        text = text[:limit] + f"… ({len(text)} characters)"
    return text if raw else html.escape(text).replace("\n", "<br>")
