"""The inspection of a model folder as rows and text: what the CLI prints and the window shows."""

from __future__ import annotations

from engine.model_folder import ModelFolder
from engine.units import human_bytes


def inspection(folder: ModelFolder) -> dict:
    nodes = []
    for info in folder.experts:
        spec = info.spec
        nodes.append({
            "layer": info.layer,
            "model_layer": info.model_layer,
            "node": info.name,
            "op_type": info.op_type,
            "experts": spec.num_experts if spec else None,
            "top_k": spec.k if spec else info.attributes.get("k"),
            "layout": spec.supported_summary() if spec else None,
            "bytes_per_expert": info.bytes_per_expert if spec else None,  # an unread layout has no expert count
            "bytes": info.weight_bytes,
            "supported": info.unsupported is None,
            "reason": info.unsupported,
        })
    template_fault = folder.tokenizer.template_fault()
    supported = all(n["supported"] for n in nodes) and template_fault is None
    return {
        "model": str(folder.folder),
        "type": folder.config.model_type,
        "context_length": folder.config.context_length,
        "expert_nodes": nodes,
        "expert_bytes": folder.expert_bytes,
        "dense_bytes": folder.dense_bytes,
        "dense_segments": len(folder.plan.segments),
        "supported": supported,
        "verdict": verdict(nodes, template_fault),
        "warnings": folder.eos_warnings,
    }


NO_EXPERT_NODES = "no expert nodes: onnxruntime runs the whole model"


def verdict(nodes: list[dict], template_fault: str | None = None) -> str:
    """`template_fault`: why the chat template cannot render a first prompt (ModelTokenizer.template_fault)."""
    if template_fault and all(n["supported"] for n in nodes):  # (unsupported nodes said first)
        return f"cannot run: {template_fault}"
    if not nodes:
        return f"runs: {NO_EXPERT_NODES}"
    unsupported = sum(not n["supported"] for n in nodes)
    if unsupported:
        return f"cannot run: {unsupported} of {len(nodes)} expert nodes are unsupported"
    return f"runs: all {len(nodes)} expert nodes are supported by our CPU kernels"


def format_inspection(report: dict) -> str:
    lines = [f"model: {report['model']} (type {report['type']}, context {report['context_length']})",
             f"{'layer':>5}  {'experts':>7}  {'top-k':>5}  {'bytes/expert':>12}  {'total':>10}  layout / node"]
    for n in report["expert_nodes"]:
        layout = n["layout"] if n["supported"] else f"UNSUPPORTED: {n['reason']}"
        lines.append(f"{n['model_layer']:>5}  {n['experts'] or '?':>7}  {n['top_k'] or '?':>5}  "
                     f"{per_expert(n):>12}  {human_bytes(n['bytes']):>10}  {layout}  [{n['node']}]")
    lines.append(f"experts: {human_bytes(report['expert_bytes'])} in {len(report['expert_nodes'])} nodes; "
                 f"dense part: {human_bytes(report['dense_bytes'])} in {report['dense_segments']} onnxruntime segments")
    lines.append(report["verdict"])
    lines += [f"warning: {warning}" for warning in report["warnings"]]
    offload = report.get("offload", {})
    if offload.get("all_resident_bytes"):  # the budget to set: the table's stored sizes do not add up to it
        lines.append(f"every expert resident on the device: an expert budget of {offload['all_resident_bytes']} bytes "
                     f"({human_bytes(offload['all_resident_bytes'])}){slot_words(report, offload['slot_bytes'])}")
    lines += offload.get("statements", [])
    return "\n".join(lines)


def slot_words(report: dict, slot_bytes: dict[str, int]) -> str:
    """', 34.5 KiB a slot: the GPU kernels' layout of 31.5 KiB stored' where every node's device slot is one size,
    other than the one size stored (as the window's estimate says it); else ''."""
    sizes = {(slot_bytes[n["node"]], n["bytes_per_expert"]) for n in report["expert_nodes"] if n["node"] in slot_bytes}
    if len(sizes) != 1:
        return ""
    (slot, stored), = sizes
    return f", {human_bytes(slot)} a slot: the GPU kernels' layout of {human_bytes(stored)} stored" if slot != stored \
        else ""


def per_expert(node: dict) -> str:
    """An inspected node's bytes per expert, '?' where its layout could not be read."""
    return "?" if node["bytes_per_expert"] is None else human_bytes(node["bytes_per_expert"])
