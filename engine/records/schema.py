"""The run record: one versioned JSON document per measured run."""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
ALL_RESIDENT = "all resident"  # a run's decode path where no expert was cold: none ran


def decode_path_run(offload: dict) -> str | None:
    """The decode path a run's cold experts took; ALL_RESIDENT where every expert was resident (the path in force,
    cpu by default, would read as decoding on the CPU; a record written before it said so is told by its placement)."""
    if offload.get("placement_mode") == "all_resident":
        return ALL_RESIDENT
    return (offload.get("decode_path") or {}).get("in_force")


# the note a run that asked for the CUDA GPU and could not have it keeps (offload["device_fallback"]), its reason inside
# (cuda_device.cuda_device_or_cpu writes it)
FALLBACK_NOTE = "The CUDA GPU was asked for but cannot be used ({}); every expert runs on the CPU instead."
_FALLBACK_HEAD, _FALLBACK_TAIL = FALLBACK_NOTE.split("{}")


def fallback_reason(note: str) -> str:
    """Why the CUDA GPU could not be used, from a FALLBACK_NOTE (the whole note where it is worded otherwise)."""
    if note.startswith(_FALLBACK_HEAD) and note.endswith(_FALLBACK_TAIL):
        return note[len(_FALLBACK_HEAD):-len(_FALLBACK_TAIL)]
    return note


class RecordError(ValueError):
    pass


class NewerRecord(RecordError):
    """A record a newer moe-workbench wrote (a newer schema version): whole, but not readable by this one."""


@dataclass
class RunRecord:
    scenario: str                         # short, long, multiturn, sweep point, side-by-side, contention, ...
    created: str                          # ISO 8601 UTC
    versions: dict
    machine: dict
    model: dict                           # folder, type, content hash, expert layouts per node
    offload: dict                         # the full configuration (onnxruntime entries), device, plan; "dense": where
    # the dense part ran ("cpu" or "cuda") and why (absent in records written before it existed); "popularity_sha256":
    # the SHA-256 of the popularity file's bytes that placed the experts (None without one; absent in older records);
    # "device_fallback" (only where the run asked for the CUDA GPU and could not have it: a scenario's, a side-by-side
    # side's; absent otherwise and in older records): why every expert ran on the CPU instead; "resident_experts" (on a
    # device; absent in older records): the experts in device slots as the run ended; "budget_bytes" (absent in older
    # records; None where offload is disabled): the expert budget the plan set, less than device_expert_bytes where the
    # device had less free (side-by-side's B beside A)
    timings: dict                         # load_s, prefill_s, time_to_first_token_s, decode_tokens_per_s, completion_s,
    # settle_s (optional: seconds waited before the run for the model's background work after load and the CPU
    # kernels' compilation, engine/kernel_warmup.py); warm_up_s (optional: seconds of the unrecorded short answer
    # given before the model's first timed run after its load, or a sweep point's first at its budget, 0 for the runs
    # after it; absent in older records, and 0 in a sweep's written before its points said theirs); point_warm_up_s
    # (a sweep's records; absent in others and in older ones): the seconds of the point's unrecorded answer at its
    # budget, which every run of the point follows, its first's warm_up_s too;
    # on a simulated device also "projected" (optional, absent in older records): decode_tokens_per_s, prefill_s,
    # completion_s on the simulated card and the bandwidths assumed (engine/offload/projection.py)
    peaks: dict                           # device_bytes, process_device_bytes, rss_bytes, rss_start_bytes,
    # pinned_bytes; device_parts (on a device; absent in older records): what the device held at its peak, by part
    # (scenarios.device_parts); other_side_loaded (side by side's records; absent in others and in older records):
    # the other side's model was loaded in this process too, so the process's RSS and VRAM peaks hold it
    # per expert node: hit rate, bytes copied, times; "swaps" (residents placement replaced as routing moved) and
    # "fills" (experts it copied into empty slots); a record written before "fills" existed counts them in "swaps"
    layers: list[dict] = field(default_factory=list)
    bytes_moved: int = 0
    # prompt, answer, tokens and timings per turn; and "reasoning", what a model that reasons first wrote before its
    # answer ("" for one that does not; absent in records written before it existed)
    turns: list[dict] = field(default_factory=list)
    approximate_routing: bool = False
    # what else used the CPUs during the run (engine/host_load.py): host_steal_share, host_others_share; empty in
    # records written before it existed
    host_load: dict = field(default_factory=dict)
    routing_agreement: float | None = None
    # approximate routing's experts dropped and substituted during the run (its passes, not the agreement meter's
    # exact ones); empty when it is off, and in records written before it existed
    approximation: dict = field(default_factory=dict)
    # how the answers were asked for (generation_settings): the length limit, sampling, stop texts, reasoning setting;
    # empty in records written before it existed (their settings are not recorded)
    generation: dict = field(default_factory=dict)
    label: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunRecord":
        if not isinstance(data, dict):  # a damaged record: `null`, a list
            raise RecordError(f"the run record is {json.dumps(data, default=repr)[:40]}, not a JSON object")
        version = data.get("schema_version")
        if isinstance(version, int) and version > SCHEMA_VERSION:
            versions = data.get("versions")
            app = versions.get("app") if isinstance(versions, dict) else None
            by = f"{app}, " if app and app != "source" else ""  # "source": a checkout's, no version to name
            raise NewerRecord(f"written by a newer moe-workbench ({by}run record schema version {version}; this one "
                              f"reads version {SCHEMA_VERSION})")
        if version != SCHEMA_VERSION:
            raise RecordError(f"run record schema version {version!r} is not {SCHEMA_VERSION}")
        known = set(cls.__dataclass_fields__)
        missing = [name for name, f in cls.__dataclass_fields__.items()
                   if name not in data and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise RecordError(f"run record lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def generated_tokens(self) -> int:
        """The tokens its answers generated, all turns together."""
        return sum(turn.get("generated_tokens", 0) for turn in self.turns)


def generation_settings(params) -> dict:
    """A GenerationParams as a record keeps it."""
    s = params.sampling
    return {"max_new_tokens": params.max_new_tokens, "do_sample": s.do_sample, "temperature": s.temperature,
            "top_k": s.top_k, "top_p": s.top_p, "repetition_penalty": s.repetition_penalty, "seed": s.seed,
            "stop_strings": list(params.stop_strings), "reasoning": params.reasoning}


def model_identity(folder) -> dict:
    """Folder, type, a content hash of model.onnx and each expert node's layout."""
    digest = hashlib.sha256(Path(folder.onnx.path).read_bytes()).hexdigest()
    nodes = []
    for info in folder.experts:
        spec = info.spec
        nodes.append({"node": info.name, "layer": info.layer, "model_layer": info.model_layer,
                      "experts": spec.num_experts if spec else None,
                      "top_k": spec.k if spec else None, "quant_type": spec.quant_type if spec else None,
                      "bits": spec.fc1_bits if spec else None, "block_size": spec.block_size if spec else None,
                      "layout": spec.supported_summary() if spec else info.unsupported,
                      "bytes_per_expert": info.bytes_per_expert})
    return {"folder": str(folder.folder), "type": folder.config.model_type, "onnx_sha256": digest,
            "expert_bytes": folder.expert_bytes, "dense_bytes": folder.dense_bytes, "expert_nodes": nodes}
