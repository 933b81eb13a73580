"""MoE Workbench engine: model loading, graph partition, expert execution, generation (no Qt)."""
