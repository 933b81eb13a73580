"""genai_config.json (the builder's layout) and README.txt for a writer-made model folder."""

from __future__ import annotations

import json

from engine.writer.spec import WriterSpec
from engine.writer.tokenizer_files import BOS_ID, EOS_ID, PAD_ID


def genai_config(spec: WriterSpec) -> dict:
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": "model.onnx",
        "head_size": spec.head_size,
        "hidden_size": spec.hidden_size,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
        },
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.num_kv_heads,
    }
    if spec.sliding_window is not None:
        decoder["sliding_window"] = {
            "window_size": spec.sliding_window,
            "slide_key_value_cache": False,
            "slide_inputs": False,
            "layers": spec.sliding_layers,
            "cache_slack": 0,
        }
    return {
        "model": {
            "bos_token_id": BOS_ID,
            "context_length": spec.context_length,
            "decoder": decoder,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "type": "gptoss",
            "vocab_size": spec.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": spec.context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def readme(spec: WriterSpec, data_bytes: int) -> str:
    lines = [
        "Written by MoE Workbench's model writer (engine/writer).",
        "",
        "The weights are RANDOM: the text this model generates is meaningless. It exists to measure",
        "and test the engine on a model of a chosen shape (onnxruntime-genai gpt-oss layout, QMoE experts).",
        "Routing spreads over all experts (random-sign scales, zero-mean embedding), a floor for any cache.",
        "",
    ]
    if spec.description:
        lines += [spec.description, ""]
    lines += [f"model.onnx.data: {data_bytes} bytes", "", "spec:"]
    lines += [f"  {k} = {v!r}" for k, v in spec.to_dict().items()]
    return "\n".join(lines) + "\n"


def spec_json(spec: WriterSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True)
