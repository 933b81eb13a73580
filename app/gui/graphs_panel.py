"""Live graphs of the machine (pyqtgraph): VRAM and GPU utilisation, host memory, CPU per core and in
total, tokens per second; 1 s samples, 10 minutes of history, pausable, with markers at load and
generation events. Without an NVIDIA GPU the GPU graphs are replaced by a line saying so."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.gui import theme
from app.gui.widgets import OneLineLabel
from engine.units import counted, human_bytes

HISTORY_S = 600
GIB = float(1 << 30)


def _pen(colour: str, width: float = 1.5, alpha: int = 255, style=Qt.PenStyle.SolidLine):
    c = QColor(colour)
    c.setAlpha(alpha)
    return pg.mkPen(c, width=width, style=style)


def _brush(colour: str, alpha: int):
    c = QColor(colour)
    c.setAlpha(alpha)
    return pg.mkBrush(c)


class AgoAxis(pg.AxisItem):
    """The time axis: samples sit at their seconds before the last (x below 0), read as 'seconds ago' (60, not -60)."""

    def tickStrings(self, values, scale, spacing):
        return super().tickStrings([abs(value) for value in values], scale, spacing)


class GraphsPanel(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("graphsPanel")
        self.samples: deque[dict] = deque()
        self.markers: list[dict] = []
        self.paused = False
        self._stale = False  # samples came while the graphs were not on screen: drawn when they show
        self._tokens = 0
        # the rate is tokens over the time spent answering within a sample, so an answer shorter than a sample reads
        # its own rate, as the chat's statistics do, not the share of the sample it took
        self._answering_since: float | None = None
        self._answering_s = 0.0
        self._simulated: dict | None = None  # the loaded model's simulated GPU, as the engine accounts it
        self._cuda_device = ""  # the CUDA GPU the loaded model runs on ('' for none)
        self._gpu_seen = False  # a sample read the GPU once
        self._theme = theme.current()

        self.pause_button = QPushButton("Pause")
        self.pause_button.setCheckable(True)
        self.pause_button.setToolTip("Freeze the graphs (sampling goes on)  Ctrl+P")
        self.pause_button.toggled.connect(self.set_paused)
        # one line that ends in an ellipsis where the dock is narrow (its tooltip says it in words); the markers'
        # legend apart, so that it shows whole
        self.status = OneLineLabel("waiting for the first sample…")
        self.legend = QLabel()
        self.legend.setToolTip("Dashed lines across the graphs: a load, an answer or records job, an error; grey, the "
                               "engine re-planned. Hover one for what it marks.")
        self.sampling_failure = QLabel(wordWrap=True, textFormat=Qt.TextFormat.PlainText)
        self.sampling_failure.hide()
        self.gpu_note = QLabel(wordWrap=True)
        self.gpu_note.hide()
        top = QHBoxLayout()
        top.addWidget(self.status, 1)
        top.addWidget(self.legend)
        top.addWidget(self.pause_button)

        pg.setConfigOptions(antialias=True)
        self.rows: dict[str, tuple[QLabel, pg.PlotWidget]] = {}
        self.vram_plot = self._plot("vram", "VRAM (GiB)")
        self.util_plot = self._plot("util", "GPU utilisation (%)")
        self.ram_plot = self._plot("ram", "Host memory (GiB)")
        self.cpu_plot = self._plot("cpu", "CPU (%)")
        self.tps_plot = self._plot("tps", "Tokens/s while answering")
        self.plots = [self.vram_plot, self.util_plot, self.ram_plot, self.cpu_plot, self.tps_plot]
        for plot in self.plots[:-1]:
            plot.setXLink(self.tps_plot)
            plot.getAxis("bottom").setStyle(showValues=False)
            plot.getAxis("bottom").setHeight(6)
        self.tps_plot.setLabel("bottom", "seconds ago")
        self.util_plot.setYRange(0, 100, padding=0.02)
        self.cpu_plot.setYRange(0, 100, padding=0.02)

        self.curves: dict[str, pg.PlotDataItem] = {}
        self.core_curves: list[pg.PlotDataItem] = []
        self._make_curves()
        self._show_legend()

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(2)
        layout.addLayout(top)
        layout.addWidget(self.sampling_failure)
        layout.addWidget(self.gpu_note)
        for header, widget in self.rows.values():
            layout.addWidget(header)
            layout.addWidget(widget, 1)
        self._show_gpu(False)

    # --- construction ------------------------------------------------------------------------------
    def _plot(self, key: str, title: str) -> pg.PlotItem:
        header = QLabel(f"<b>{title}</b>")
        header.setWordWrap(True)
        widget = pg.PlotWidget(axisItems={"bottom": AgoAxis("bottom")})
        widget.setMinimumHeight(70)
        widget.setAccessibleName(title)
        plot = widget.getPlotItem()
        plot.setMenuEnabled(False)
        plot.setMouseEnabled(x=False, y=False)
        plot.hideButtons()
        plot.setClipToView(True)
        plot.setDownsampling(mode="peak")
        plot.showGrid(x=True, y=True, alpha=0.25)
        plot.getAxis("left").setWidth(36)
        self.rows[key] = (header, widget)
        plot.header = header
        return plot

    def _show_gpu(self, gpu: bool) -> None:
        for key in ("vram", "util"):
            for widget in self.rows[key]:
                widget.setVisible(gpu)
        self._gpu_rows_shown = gpu

    def _make_curves(self) -> None:
        t = self._theme
        for plot in self.plots:
            plot.clear()
        self.curves = {
            "vram_used": self.vram_plot.plot(pen=_pen(t.others), fillLevel=0, brush=_brush(t.others, 90)),
            "vram_this": self.vram_plot.plot(pen=_pen(t.accent), fillLevel=0, brush=_brush(t.accent, 120)),
            "vram_total": self.vram_plot.plot(pen=_pen(t.muted, 1, style=Qt.PenStyle.DashLine)),
            "gpu_util": self.util_plot.plot(pen=_pen(t.accent), fillLevel=0, brush=_brush(t.accent, 60)),
            "ram_used": self.ram_plot.plot(pen=_pen(t.others), fillLevel=0, brush=_brush(t.others, 90)),
            "ram_this": self.ram_plot.plot(pen=_pen(t.accent), fillLevel=0, brush=_brush(t.accent, 120)),
            "ram_total": self.ram_plot.plot(pen=_pen(t.muted, 1, style=Qt.PenStyle.DashLine)),
            "cpu_total": None,
            "tps": self.tps_plot.plot(pen=_pen(t.tokens, 2), fillLevel=0, brush=_brush(t.tokens, 70)),
        }
        self.core_curves = []
        self.curves["cpu_total"] = self.cpu_plot.plot(pen=_pen(t.accent, 2))
        for marker in self.markers:
            marker["lines"] = []

    def apply_theme(self, t: theme.Theme) -> None:
        self._theme = t
        for _header, widget in self.rows.values():
            widget.setBackground(t.background)
        for plot in self.plots:
            for name in ("left", "bottom"):
                axis = plot.getAxis(name)
                axis.setPen(pg.mkPen(t.grid))
                axis.setTextPen(pg.mkPen(t.muted))
        self._make_curves()
        self._show_legend()
        self._redraw(force=True)

    def _show_legend(self) -> None:
        t = self._theme
        self.legend.setText(" ".join(f"<span style='color:{colour}'>┆</span> {kind}" for colour, kind in
                                     ((t.accent, "load"), (t.tokens, "answer"), (t.error, "error"))))

    # --- data in -----------------------------------------------------------------------------------
    def count_tokens(self, n: int = 1) -> None:
        self._tokens += n

    def set_answering(self, answering: bool, now: float | None = None) -> None:
        """A chat answer starts or ends (`now`: when the worker said so): the time between counts toward the rate."""
        now = time.monotonic() if now is None else now
        if answering and self._answering_since is None:
            self._answering_since = now
        elif not answering and self._answering_since is not None:
            self._answering_s += max(0.0, now - self._answering_since)
            self._answering_since = None

    def add_marker(self, text: str, kind: str = "event") -> None:
        self.markers.append({"t": time.monotonic(), "text": text, "kind": kind, "lines": []})
        self._redraw()

    def show_sampling_failure(self, line: str) -> None:
        """The sampler's one line on samples that fail (app.gui.telemetry), until the next that works."""
        self.sampling_failure.setText(line)
        self.sampling_failure.show()

    def add_sample(self, sample: dict) -> None:
        """A telemetry sample, with the rate of the tokens counted since the last one over the time answered since.
        The time is as the threads that send them saw it (the sample's `sent`, the answer's start and end as the
        worker said them: set_answering's `now`), which orders them as this thread receives them, with the tokens
        between: this thread's own clock as they arrive gave a sample all the tokens of a backlog it caught up on at
        once over the moment it took to, and read hundreds of tokens a second where the answer made a hundred.
        (The sample's `t`, taken up to a few tenths of a second before it is sent, would cut its time short against
        the tokens counted up to its sending and give the next the rest: the rate swung too high, then too low.)"""
        self.sampling_failure.hide()
        sample = dict(sample)
        clock = sample.get("sent", time.monotonic())
        answering = self._answering_s
        if self._answering_since is not None:  # still answering: the sample takes the time so far
            answering += max(0.0, clock - self._answering_since)
            self._answering_since = max(clock, self._answering_since)
        sample["tokens_per_s"] = self._tokens / answering if self._tokens and answering > 0 else 0.0
        self._tokens = 0
        self._answering_s = 0.0
        self.samples.append(sample)
        while self.samples and self.samples[0]["t"] < sample["t"] - HISTORY_S:
            self.samples.popleft()
        gpu = sample.get("gpu") is not None
        self._gpu_seen = self._gpu_seen or gpu
        if gpu != self._gpu_rows_shown:
            self._show_gpu(gpu)
        self._show_note(sample)
        self._redraw()

    def set_simulated_memory(self, memory: dict | None) -> None:
        """The loaded model's simulated GPU memory (used, high_water, ceiling, name), or None without one."""
        self._simulated = memory
        if self.samples:
            self._show_note(self.samples[-1])

    def _show_note(self, sample: dict) -> None:
        """The note under the graphs: without a GPU sample, why (_show_gpu_note); beside the GPU graphs, the simulated
        GPU's memory where a model runs on one (the graphs are this machine's card, not the one simulated)."""
        if sample.get("gpu") is None:
            self._show_gpu_note(sample.get("gpu_note") or "no NVIDIA GPU", sample.get("gpu_retrying", False))
        elif self._simulated:
            self.gpu_note.setText(self._simulated_words("the engine's own count; the graphs show this machine's GPU"))
            self.gpu_note.show()
        else:
            self.gpu_note.hide()

    def set_cuda_device(self, name: str) -> None:
        """The CUDA GPU the loaded model runs on ('' for none): where NVML gives no reading, the GPU is there all the
        same."""
        self._cuda_device = name
        if self.samples:
            self._show_note(self.samples[-1])

    def _simulated_words(self, whose: str) -> str:
        memory = self._simulated
        return (f"<b>{memory['name']}</b> ({whose}): {human_bytes(memory['used'])} in use of "
                f"{human_bytes(memory['ceiling'])}, high-water {human_bytes(memory['high_water'])}.")

    def _show_gpu_note(self, why: str, retrying: bool) -> None:
        """Without an NVIDIA GPU to sample: why, and the simulated GPU's memory where a model runs on one. `retrying`:
        NVML is asked again (why says when); the graphs come back only then."""
        if self._gpu_seen:  # it answered before: NVML fails now, the GPU is there
            text = f"<b>GPU:</b> {why}." + (" The VRAM and GPU utilisation graphs come back when it answers again."
                                            if retrying else "")
        elif self._cuda_device:  # CUDA works where NVML does not (a container without libnvidia-ml, nvmlInit refused)
            text = (f"<b>GPU:</b> the model runs on <b>{self._cuda_device}</b>, but NVML, which the VRAM and GPU "
                    f"utilisation graphs read, gives no reading ({why}).")
        elif retrying:
            text = f"<b>GPU:</b> {why}. VRAM and GPU utilisation graphs appear when it answers."
        else:
            text = f"<b>GPU:</b> {why}. VRAM and GPU utilisation graphs appear on a machine with one."
        if self._simulated:
            text += "<br>" + self._simulated_words("the engine's own count")
        self.gpu_note.setText(text)
        self.gpu_note.show()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.pause_button.setChecked(paused)
        self.pause_button.setText("Resume" if paused else "Pause")
        self._redraw(force=True)  # (paused: the status line says so over the frozen graphs)

    @property
    def sample_count(self) -> int:
        return len(self.samples)

    # --- drawing -----------------------------------------------------------------------------------
    def catch_up(self) -> None:
        """Shown again (its dock, or the window restored): what was sampled meanwhile, drawn at once."""
        if self._stale:
            self._redraw()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.catch_up()

    def _redraw(self, force: bool = False) -> None:
        if (self.paused and not force) or not self.samples:
            return
        # not on screen (its dock closed or behind another tab, the window minimised): the samples are kept, the
        # drawing waits until it shows
        if not self.isVisible() or self.window().isMinimized():
            self._stale = True
            return
        self._stale = False
        t = self._theme
        samples = list(self.samples)
        now = samples[-1]["t"]
        x = np.array([s["t"] - now for s in samples])

        def col(key, scale=1.0):
            return np.array([float(s.get(key) or 0.0) for s in samples]) / scale

        ram_total = col("ram_total", GIB)
        ram_this = col("ram_this", GIB)
        ram_others = col("ram_others", GIB)
        self.curves["ram_this"].setData(x, ram_this)
        self.curves["ram_used"].setData(x, ram_this + ram_others)
        self.curves["ram_total"].setData(x, ram_total)
        last = samples[-1]
        # (all that is neither available nor this process's: the kernel's own page tables, slab and buffers are in it)
        self.ram_plot.header.setText(
            _title("Host memory", [(t.accent, f"this process {human_bytes(last['ram_this'])}"),
                                   (t.others, f"other processes and the kernel {human_bytes(last['ram_others'])}"),
                                   (t.muted, f"available {human_bytes(last['ram_available'])} of "
                                             f"{human_bytes(last['ram_total'])}")], t))
        # scaled to what is used (the total is in the header): a 23 GiB axis would flatten a model's growth
        used_peak = float((ram_this + ram_others).max()) if len(ram_this) else 0.1
        self.ram_plot.setYRange(0, max(used_peak * 1.25, 0.1), padding=0)

        per_core = [s.get("cpu_per_core") or [0.0] for s in samples]
        # a CPU put on- or offline changes the count: samples without an entry leave a gap in its line
        width = max(map(len, per_core))
        cores = np.array([row + [np.nan] * (width - len(row)) for row in per_core], dtype=float)
        while len(self.core_curves) < cores.shape[1]:
            self.core_curves.append(self.cpu_plot.plot(pen=_pen(t.muted, 1, alpha=110), connect="finite"))
        for index, curve in enumerate(self.core_curves):
            curve.setData(x, cores[:, index] if index < cores.shape[1] else np.zeros_like(x))
        self.curves["cpu_total"].setData(x, col("cpu_total"))
        self.curves["cpu_total"].setZValue(10)
        count = len(per_core[-1])
        ours = len(last.get("cpu_ours") or range(count))
        where = "" if ours == count else f" of this process's {ours}"  # (its affinity)
        self.cpu_plot.header.setText(
            _title("CPU", [(t.accent, f"total {last['cpu_total']:.0f}%"),
                           (t.muted, f"{count} cores"),
                           (t.others, f"other processes {last.get('others_cpu_cores', 0):.1f} cores{where}")], t))

        tps = col("tokens_per_s")
        self.curves["tps"].setData(x, tps)
        self.tps_plot.header.setText(_title("Tokens/s while answering", [(t.tokens, f"now {tps[-1]:.1f}"),
                                                   (t.muted, f"peak {tps.max():.1f}")], t))
        self.tps_plot.setYRange(0, max(1.0, float(tps.max()) * 1.15), padding=0)

        gpu = last.get("gpu")
        if gpu:
            gs = [s.get("gpu") or {} for s in samples]
            this = np.array([g.get("this", 0) for g in gs], dtype=float) / GIB
            used = np.array([g.get("used", 0) for g in gs], dtype=float) / GIB
            total = np.array([g.get("total", 0) for g in gs], dtype=float) / GIB
            self.curves["vram_this"].setData(x, this)
            self.curves["vram_used"].setData(x, used)
            self.curves["vram_total"].setData(x, total)
            self.vram_plot.setYRange(0, max(total.max(), 0.1) * 1.02, padding=0)
            if gpu.get("per_process", True):  # (the driver's own reservations are no process's: said apart)
                listed = min(gpu["others"], gpu.get("listed", 0))
                held = [(t.accent, f"this process {human_bytes(gpu['this'])}"),
                        (t.others, f"other processes {human_bytes(listed)}, driver and display "
                                   f"{human_bytes(gpu['others'] - listed)}")]
            else:  # (this process's share unknown: 0 is not its figure)
                held = [(t.others, f"in use {human_bytes(gpu['used'])} (this process's and others': the driver does "
                                   "not say whose)")]
            self.vram_plot.header.setText(
                _title(f"VRAM — {gpu.get('name', 'GPU')}",
                       held + [(t.muted, f"free {human_bytes(gpu['free'])} of {human_bytes(gpu['total'])}")], t))
            util = np.array([g.get("util") or 0.0 for g in gs], dtype=float)
            self.curves["gpu_util"].setData(x, util)
            self.util_plot.header.setText(_title("GPU utilisation", [(t.accent, f"{util[-1]:.0f}%")], t))

        span = max(60.0, -float(x[0]) if len(x) else 60.0)
        self.tps_plot.setXRange(-span, 0, padding=0.01)
        self._draw_markers(now)
        # short, paused first (what a narrow dock cuts is the time's end); the tooltip says it in words
        taken = time.strftime('%H:%M:%S', time.localtime(last['wall']))
        self.status.setText(("paused · " if self.paused else "") + f"{counted(len(samples), 'sample')} · {taken}")
        self.status.setToolTip(f"{counted(len(samples), 'sample')} kept (the last {HISTORY_S // 60} minutes), the last "
                               f"taken at {taken}" + ("; paused: the graphs stay as they are, sampling goes on"
                                                      if self.paused else ""))

    def _draw_markers(self, now: float) -> None:
        t = self._theme
        colours = {"load": t.accent, "generate": t.tokens, "error": t.error, "event": t.muted}
        kept = []
        for marker in self.markers:
            if marker["t"] < now - HISTORY_S:
                for plot, line in marker["lines"]:
                    plot.removeItem(line)
                continue
            kept.append(marker)
            if not marker["lines"]:
                for plot in self.plots:
                    pen = _pen(colours.get(marker["kind"], t.muted), 1.2, 200, Qt.PenStyle.DashLine)
                    line = pg.InfiniteLine(angle=90, movable=False, pen=pen)
                    line.setToolTip(marker["text"])
                    plot.addItem(line, ignoreBounds=True)
                    marker["lines"].append((plot, line))
            for _plot, line in marker["lines"]:
                line.setValue(marker["t"] - now)
        self.markers = kept


def _title(name: str, parts: list[tuple[str, str]], t: theme.Theme) -> str:
    body = " &nbsp; ".join(f"<span style='color:{c}'>■</span> <span style='color:{t.text}'>{text}</span>"
                           for c, text in parts)
    return f"<span style='color:{t.text}'><b>{name}</b></span> &nbsp; {body}"
