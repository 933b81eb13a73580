"""The embedded demo model, written into the user's cache on first use."""
from __future__ import annotations

import engine.demo_model as demo


def test_a_demo_another_process_wrote_meanwhile_is_used(tmp_path, monkeypatch):
    """Two windows started at once on a first run both write the demo; the one that renames second found the
    folder there and failed (OSError: Directory not empty) where the other's complete copy serves it."""
    write_model = demo.write_model

    def another_process_first(folder, spec):
        write_model(tmp_path / "other", spec)
        (tmp_path / "other").rename(demo.demo_model_path(tmp_path))
        write_model(folder, spec)

    monkeypatch.setattr(demo, "write_model", another_process_first)
    assert demo.ensure_demo_model(tmp_path) == tmp_path / demo.DEMO_NAME
    assert [path.name for path in tmp_path.iterdir()] == [demo.DEMO_NAME]  # its own copy removed
    assert (tmp_path / demo.DEMO_NAME / "genai_config.json").is_file()
