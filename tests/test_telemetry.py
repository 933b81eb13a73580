"""The window's telemetry thread (app.gui.telemetry)."""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("pytestqt")

import app.gui.telemetry as telemetry  # noqa: E402


def test_the_probe_and_nvml_open_on_the_callers_thread_not_the_samplers(qtbot, monkeypatch):
    """Opening NVML loads its library (a dlopen): done on the window's thread before the sampler's thread starts, so
    that thread never loads a library while the window's thread builds Qt objects (that deadlocked the suite)."""
    opened = []
    monkeypatch.setattr(telemetry, "Nvml", lambda: opened.append(threading.get_ident()) or _NoGpu())
    sampler = telemetry.SamplerThread(interval_ms=20, nvml=True)
    try:
        assert opened == [threading.get_ident()]
        with qtbot.waitSignal(sampler.sampler.sampled, timeout=5000) as sampled:
            pass
        assert sampled.args[0]["gpu"] is None and sampled.args[0]["gpu_note"] == "no GPU here"
        assert 0.0 <= sampled.args[0]["cpu_steal_share"] <= 1.0  # (a share of the CPUs' time; 0 off Linux)
        assert opened == [threading.get_ident()]  # the samples did not open it again
    finally:
        sampler.stop()


class _NoGpu:
    note = "no GPU here"

    def sample(self):
        return None
