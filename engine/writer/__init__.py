"""Model writer: random-weight MoE models in onnxruntime-genai's builder format (gpt-oss layout, QMoE)."""

from engine.writer.spec import WriterSpec
from engine.writer.write import model_data_bytes, write_model

__all__ = ["WriterSpec", "model_data_bytes", "write_model"]
