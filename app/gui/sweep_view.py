"""The budget sweep in the window: N expert budgets from none to all on the loaded model (re-planned,
not reloaded), the scenarios at each; device-memory peak, RAM peak, completion time and tokens/s
against the budget, the recommended point marked, and the recommendation saved as a named
configuration."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QGridLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QSpinBox, QVBoxLayout, QWidget)

from app.gui import theme
from app.gui.budget_panel import PATHS, SPLITS
from app.gui.job_bar import JobBar
from app.gui.records_jobs import SweepJob, SweepResult, scenario_names
from app.gui.widgets import MAX_ANSWER_TOKENS, AnswersChoice, ReasoningChoice
from engine.errors import one_line
from engine.offload import OffloadConfig
from engine.offload.approximate import agreement_text
from engine.records.configurations import save_configuration
from engine.records.lengths import SWEEP_REPEATS, SWEEP_TOKENS

REPEATS_MAX = 9  # a sweep's runs at each budget, at most (each repeat is a whole pass over the scenarios)
from engine.records.scenarios import SCENARIOS
from engine.records.sweep import (DISABLED_REFUSED, Recommendation, SweepPoint, device_parts_line,
                                  point_warm_ups_line, reasoning_length_note, recommendation, uses_projection)
from engine.units import counted, decode_rate, duration_text, human_bytes

KIND = "sweeping"
# (key, title, what a point gives, whether it is bytes: those are drawn in the unit that fits)
PANELS = (("device", "device memory peak", lambda p: p.peak_device_bytes, True),
          ("rss", "process RAM peak", lambda p: p.peak_rss_bytes, True),
          ("completion", "completion time (s)", lambda p: p.completion_s, False),
          ("tokens", "decode (tokens/s)", lambda p: p.decode_tokens_per_s, False))
# On a simulated device, the same panels' values projected for the simulated card (engine/offload/projection.py):
# its measured wall time computes the card's experts on the CPU, so they, not the measured ones, say what the card
# would give; the recommendation follows the projected completion time there.
PROJECTED = {"completion": lambda p: p.projected_completion_s, "tokens": lambda p: p.projected_decode_tokens_per_s}
# A budget whose answers were one token each has no decode rate (no decode step after the prefill's token): the rate
# plot leaves it out, and says so, rather than draw it at 0 tok/s.
RATES = {"tokens"}


def sentence(note: str) -> str:
    """reasoning_length_note's words as the view says them ("" stays "")."""
    return f"{note[:1].upper()}{note[1:]}; Tokens sets another." if note else ""


def byte_unit(largest: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1


def left_out_words(left: list[int]) -> str:
    """Which budgets the rate plot leaves out (RATES) and why ('' where none)."""
    if not left:
        return ""
    return (f"Decode leaves out {', '.join(human_bytes(b) for b in left)}: the answers there were one token each, "
            "which the prefill gives, so there was no decode step to time.")


def legend_text(projected: bool, whole: bool, left: list[int], parts: str = "", warm_up: str = "",
                warm_ups: str = "") -> str:
    """What the plots' lines and marks are, said once beside them (a plot's title sets its column's width); `parts`:
    what the device peaks are made of (device_parts_line); `warm_up`: what the unrecorded answer before the first
    point took (warm_up_line), which no point's runs time; `warm_ups`: what each point's took, which all its runs
    follow (point_warm_ups_line)."""
    return " ".join(["Solid line, dots: measured on this machine.",
                     *(["Dashed, triangles: projected for the simulated card."] if projected else []),
                     *(["Squares: on whole layers."] if whole else []), "Red ring: the recommended budget.",
                     *([f"{parts[:1].upper()}{parts[1:]}."] if parts else []),
                     *([f"{warm_ups[:1].upper()}{warm_ups[1:]}."] if warm_ups else []),
                     *([left_out_words(left)] if left else []),
                     *([f"{warm_up[:1].upper()}{warm_up[1:]}."] if warm_up else [])])


def intro_text(repeats: int) -> str:
    """What a sweep does, before one has run: its runs at each budget, how it recommends, and what it refuses (in
    the refusal's words)."""
    runs = "once" if repeats == 1 else f"{repeats} times"
    within = "" if repeats == 1 else ", or within the spread between their repeats"
    return (f"Runs the scenarios {runs} at each budget on the loaded model (it needs a simulated or CUDA device) and "
            f"recommends, of the budgets whose median completion is within the margin of the fastest{within}, the one "
            f"with the least device memory peak. {DISABLED_REFUSED[:1].upper()}{DISABLED_REFUSED[1:]}.")


class SweepLength(QSpinBox):
    """Tokens: the answer length, the same for every model. `chosen` is the user's, which the settings keep (None:
    SWEEP_TOKENS, the sweep's own)."""

    def __init__(self):
        super().__init__(minimum=1, maximum=MAX_ANSWER_TOKENS, value=SWEEP_TOKENS)

    @property
    def chosen(self) -> int | None:
        return None if self.value() == SWEEP_TOKENS else self.value()

    def choose(self, tokens: int | None) -> None:
        """The user's length, as saved settings restore it (None: the sweep's own)."""
        self.setValue(tokens or SWEEP_TOKENS)


class SweepView(QWidget):
    jobRequested = Signal(str, object)
    cancelRequested = Signal()
    recorded = Signal(list)
    failed = Signal(str)

    def __init__(self, history_path=None, configurations_path=None, parent=None):
        super().__init__(parent)
        self.history_path = str(history_path) if history_path else None
        self.configurations_path = configurations_path
        self.result: SweepResult | None = None
        self.recommended: SweepPoint | None = None
        self.recommendation: Recommendation | None = None  # the recommended point and why (its saved note)
        self.model_tokens: int | None = None  # the loaded model's own length where it reasons first (set_model)
        self.points = QSpinBox(minimum=2, maximum=50, value=5)
        self.points.setAccessibleName("Budget points")
        self.scenario = QComboBox()
        for name in (*SCENARIOS, "all"):
            self.scenario.addItem(name)
        self.scenario.setAccessibleName("Scenarios at each point")
        self.max_tokens = SweepLength()
        self.max_tokens.setAccessibleName("Answer tokens")
        self.max_tokens.setToolTip(f"The answer length, the same for every model ({SWEEP_TOKENS} unless you set one, "
                                   "which is kept when the window reopens): a sweep times the same work at each "
                                   "budget; a model that reasons first spends it on its reasoning, which decodes as an "
                                   "answer does")
        self.answers = AnswersChoice()
        self.reasoning = ReasoningChoice()
        self.length_note = QLabel()  # said before a sweep runs, not only as it ends
        self.length_note.setWordWrap(True)
        self.length_note.setAccessibleName("Answer length note")
        self.length_note.hide()
        self.margin = QDoubleSpinBox(minimum=0.0, maximum=100.0, value=10.0, suffix=" %", decimals=1, singleStep=1.0)
        self.margin.setAccessibleName("Margin")
        self.margin.setToolTip("Of the budgets whose completion time is within this much of the fastest, recommend the "
                               "one with the least device memory peak (of equal peaks the smaller budget)")
        self.both_splits = QCheckBox("Both layer splits")
        self.both_splits.setToolTip("At every budget that holds some but not all layers whole, run the budget spread over "
                                    "every layer and on whole layers (squares), and recommend across both: the "
                                    "engine's own trial needs more decode steps than a sweep's scenarios give")
        self.bar = JobBar("Sweep", "Stop at the next token; the points completed are kept (shown and saved)")
        self.legend = QLabel()
        self.legend.setWordWrap(True)
        self.legend.setAccessibleName("What the plots show")
        self.legend.hide()
        self.repeats = QSpinBox(minimum=1, maximum=REPEATS_MAX, value=SWEEP_REPEATS)
        self.repeats.setAccessibleName("Repeats")
        self.repeats.setToolTip("Times each budget runs the scenarios, after an unrecorded warm-up answer: the times "
                                "compared are their medians, and two budgets whose medians lie within the spread "
                                f"between their repeats are a tie. 1 takes about 1/{SWEEP_REPEATS} of the time of "
                                f"{SWEEP_REPEATS}, and one slow run then decides.")
        self.summary = QLabel(intro_text(SWEEP_REPEATS))
        self.summary.setWordWrap(True)
        self.summary.setAccessibleName("Sweep recommendation")
        self.name = QLineEdit(placeholderText="configuration name")
        self.name.setAccessibleName("Configuration name")
        self.save_button = QPushButton("Save as configuration")
        self.save_button.setEnabled(False)
        self.plots: dict[str, pg.PlotItem] = {}
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.marks: dict[str, pg.InfiniteLine] = {}
        self.chosen: dict[str, pg.ScatterPlotItem] = {}
        self.projected_curves: dict[str, pg.PlotDataItem] = {}  # PROJECTED's panels, empty off a simulated device
        self.whole: dict[str, pg.ScatterPlotItem] = {}  # the whole-layer points (squares), where the sweep ran both
        self.projected_whole: dict[str, pg.ScatterPlotItem] = {}
        self.projected = False  # the points shown carry projections (a sweep on the simulated device)
        self.canvas = pg.GraphicsLayoutWidget()
        self.canvas.setMinimumSize(480, 260)  # two plots a row stay readable; a narrower dock scrolls (scrolled)
        self.scales: dict[str, tuple[str, int]] = {}
        for index, (key, heading, _get, _is_bytes) in enumerate(PANELS):
            plot = self.canvas.addPlot(row=index // 2, col=index % 2, title=heading)
            plot.setLabel("bottom", "expert budget")
            plot.showGrid(x=True, y=True, alpha=0.3)
            for axis in ("left", "bottom"):
                plot.getAxis(axis).enableAutoSIPrefix(False)
            if self.plots:  # one budget axis: the decode plot's, where it leaves budgets out, spans them all too
                plot.setXLink(self.plots["device"])
            self.plots[key] = plot
            self.curves[key] = plot.plot([], [], symbol="o")
            if key in PROJECTED:
                self.projected_curves[key] = plot.plot([], [], symbol="t")
                self.projected_whole[key] = pg.ScatterPlotItem(symbol="s", size=9)
                plot.addItem(self.projected_whole[key])
            self.whole[key] = pg.ScatterPlotItem(symbol="s", size=9)
            plot.addItem(self.whole[key])
            self.chosen[key] = pg.ScatterPlotItem(size=14)
            plot.addItem(self.chosen[key])
            self.marks[key] = pg.InfiniteLine(angle=90, movable=False)
            self.marks[key].hide()
            plot.addItem(self.marks[key])

        options = QGridLayout()
        options.addWidget(QLabel("Points"), 0, 0)
        options.addWidget(self.points, 0, 1)
        options.addWidget(QLabel("Scenarios"), 0, 2)
        options.addWidget(self.scenario, 0, 3)
        options.addWidget(QLabel("Tokens"), 1, 0)
        options.addWidget(self.max_tokens, 1, 1)
        options.addWidget(QLabel("Margin"), 1, 2)
        options.addWidget(self.margin, 1, 3)
        options.addWidget(QLabel("Answers"), 2, 0)
        options.addWidget(self.answers, 2, 1)
        options.addWidget(self.both_splits, 2, 2, 1, 2)
        options.addWidget(QLabel("Repeats"), 3, 0)
        options.addWidget(self.repeats, 3, 1)
        options.addWidget(QLabel("Reasoning"), 3, 2)
        options.addWidget(self.reasoning, 3, 3)
        save = QHBoxLayout()
        save.addWidget(self.name, 1)
        save.addWidget(self.save_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(options)
        layout.addWidget(self.length_note)
        layout.addWidget(self.answers.note)
        layout.addWidget(self.bar)
        layout.addWidget(self.canvas, 1)
        layout.addWidget(self.legend)
        layout.addWidget(self.summary)
        layout.addLayout(save)
        self.bar.runRequested.connect(self.run)
        self.bar.cancelRequested.connect(self.cancelRequested)
        self.margin.valueChanged.connect(lambda _v: self._recommend())
        self.max_tokens.valueChanged.connect(lambda _v: self._show_length_note())
        self.reasoning.currentIndexChanged.connect(lambda _index: self._show_length_note())
        self.repeats.valueChanged.connect(self._show_intro)
        self.save_button.clicked.connect(lambda: self.save())
        self.apply_theme(theme.current())

    def apply_theme(self, t: theme.Theme) -> None:
        self._theme = t
        self.canvas.setBackground(t.background)
        for key, plot in self.plots.items():
            plot.setTitle(plot.titleLabel.text, color=t.text)
            for name in ("left", "bottom"):
                plot.getAxis(name).setPen(pg.mkPen(t.grid))
                plot.getAxis(name).setTextPen(pg.mkPen(t.muted))
            self.curves[key].setPen(pg.mkPen(t.accent, width=2))
            self.curves[key].setSymbolBrush(pg.mkBrush(t.accent))
            if key in self.projected_curves:
                self.projected_curves[key].setPen(pg.mkPen(t.others, width=2, style=pg.QtCore.Qt.PenStyle.DashLine))
                self.projected_curves[key].setSymbolBrush(pg.mkBrush(t.others))
                self.projected_whole[key].setBrush(pg.mkBrush(t.others))
            self.whole[key].setBrush(pg.mkBrush(t.accent))
            self.chosen[key].setPen(pg.mkPen(t.error, width=2))
            self.chosen[key].setBrush(pg.mkBrush(None))
            self.marks[key].setPen(pg.mkPen(t.error, width=1, style=pg.QtCore.Qt.PenStyle.DashLine))

    def set_state(self, busy: str, loaded: bool) -> None:
        self.bar.set_state(bool(busy), loaded)

    def set_model(self, reasoning_tokens: int | None) -> None:
        """The loaded model's own length where it reasons first (LoadedModel.reasoning_answer_tokens), else None
        (one that answers at once, or none loaded)."""
        self.model_tokens = reasoning_tokens
        self._show_length_note()

    def _show_intro(self, repeats: int) -> None:
        """What a sweep with `repeats` will do, where no sweep's outcome is shown."""
        if self.result is None:
            self.summary.setText(intro_text(repeats))

    def _show_length_note(self) -> None:
        note = reasoning_length_note(self.model_tokens, self.max_tokens.value(), self.reasoning.currentData())
        self.length_note.setText(sentence(note))
        self.length_note.setVisible(bool(note))

    def run(self) -> None:
        job = SweepJob(self.points.value(), scenario_names(self.scenario.currentText()), self.max_tokens.value(),
                       self.history_path, both_splits=self.both_splits.isChecked(), repeats=self.repeats.value(),
                       reasoning=self.reasoning.currentData(), **self.answers.job_settings())
        self.bar.start(f"Sweeping {job.points} budgets…")
        self.jobRequested.emit(KIND, job)

    # --- from the worker ---------------------------------------------------------------------------
    def on_progress(self, fraction: float, text: str) -> None:
        self.bar.set_progress(fraction, text)

    def on_finished(self, result: SweepResult) -> None:
        self.result = result
        self.plot(result.points, result.warm_up)
        if result.stopped_at:
            self._stopped_partway(result)
            return
        self._recommend()
        note = result.length_note
        back = result.budgets_back if result.not_restored else ""  # a data file changed after the last point
        lines = [line[:1].upper() + line[1:] for line in (result.skipped, result.left_out, back) if line]
        self.bar.finish(" ".join([f"{len(result.points)} points; {len(result.saved_ids)} runs saved to the history.",
                                  *(f"{line}." for line in lines)] + ([sentence(note)] if note else [])))
        if result.skipped:  # in the error banner too, as Record says a scenario it skips
            self.failed.emit(lines[0])
        if back:
            self.failed.emit(lines[-1])
        if result.saved_ids:
            self.recorded.emit(result.saved_ids)

    def _stopped_partway(self, result: SweepResult) -> None:
        """Cancelled or failed at a point: the points before it are drawn and saved, without a recommendation (the
        budgets above that point were never timed), as the command line keeps them."""
        self.recommended = None
        self.save_button.setEnabled(False)
        done = len(result.points)
        kept = (f"the {counted(done, 'point')} before it {'is' if done == 1 else 'are'} shown, "
                f"{counted(len(result.saved_ids), 'run')} saved to the history" if done
                else "no point completed before it")
        line = f"Failed {result.stopped_at}: {result.failure}" if result.failure else f"Cancelled {result.stopped_at}"
        line += f"; {kept}; no recommendation; {result.budgets_back}."
        self.summary.setText(f"No recommendation: the sweep stopped {result.stopped_at}, and the budgets from there on "
                             "were not timed.")
        self.bar.finish(line)
        if result.failure:
            self.failed.emit(line)
        if result.saved_ids:
            self.recorded.emit(result.saved_ids)

    def on_failed(self, message: str) -> None:
        """Failed before any point: the earlier sweep's points and recommendation go, as a sweep stopped before its
        first point leaves none (they would read as this sweep's)."""
        self.result = None
        self.recommended = None
        self.save_button.setEnabled(False)
        self.plot([])
        self.summary.setText("No recommendation: the sweep failed before any budget was timed.")
        self.bar.finish(f"Failed: {message}")

    # --- plots and the recommendation ---------------------------------------------------------------
    def plot(self, points: list[SweepPoint], warm_up: str = "") -> None:
        """Each panel against the budget; bytes in the unit that fits (self.x / self.y give plotted values). Where
        the sweep ran both layer splits, the whole-layer points are squares beside the spread's curve. `warm_up`: the
        sweep's answer before its first point (SweepResult.warm_up), said in the legend beside them."""
        self.scales["budget"] = byte_unit(max((p.budget_bytes for p in points), default=0))
        self.projected = uses_projection(points)
        left: list[int] = []  # the budgets the rate plot leaves out
        for key, heading, get, is_bytes in PANELS:
            shown = [p for p in points if get(p)] if key in RATES else points
            if key in RATES:
                left = sorted({p.budget_bytes for p in points} - {p.budget_bytes for p in shown})
            whole = [p for p in shown if p.split == "whole"]
            curve_points = [p for p in shown if p.split != "whole"]  # every budget once
            if is_bytes:
                self.scales[key] = byte_unit(max((get(p) or 0 for p in points), default=0))
                self.plots[key].setTitle(f"{heading} ({self.scales[key][0]})", color=self._theme.text)
            elif key in PROJECTED:
                title = heading + (f" · {counted(len(left), 'budget')} left out" if key in RATES and left else "")
                self.plots[key].setTitle(title, color=self._theme.text)
                if key in RATES:
                    self.plots[key].setToolTip(left_out_words(left))
                curve = self.projected_curves[key]
                if self.projected:
                    curve.setData([self.x(p) for p in curve_points], [PROJECTED[key](p) or 0 for p in curve_points])
                    self.projected_whole[key].setData([self.x(p) for p in whole],
                                                      [PROJECTED[key](p) or 0 for p in whole])
                else:
                    curve.setData([], [])
                    self.projected_whole[key].setData([], [])
            self.plots[key].setLabel("bottom", f"expert budget ({self.scales['budget'][0]})")
            self.curves[key].setData([self.x(p) for p in curve_points], [self.y(key, p) for p in curve_points])
            self.whole[key].setData([self.x(p) for p in whole], [self.y(key, p) for p in whole])
            self.chosen[key].setData([], [])
            self.marks[key].hide()
        self.legend.setText(legend_text(self.projected, any(p.split == "whole" for p in points), left,
                                        device_parts_line(points), warm_up, point_warm_ups_line(points)))
        self.legend.show()

    def x(self, point: SweepPoint) -> float:
        return point.budget_bytes / self.scales["budget"][1]

    def y(self, key: str, point: SweepPoint) -> float:
        get, is_bytes = next((g, b) for k, _h, g, b in PANELS if k == key)
        return (get(point) or 0) / (self.scales[key][1] if is_bytes else 1)

    def _recommend(self) -> None:
        if self.result is None or self.result.stopped_at or not self.result.points:
            return
        margin = self.margin.value() / 100
        chosen = self.recommendation = recommendation(self.result.points, margin)
        best = self.recommended = chosen.point
        where = {"whole": ", on whole layers", "spread": ", spread over every layer"}.get(best.split, "")
        for key, *_rest in PANELS:
            # on a simulated device the recommended point is marked on the projected curve it was chosen by
            y = (PROJECTED[key](best) or 0) if self.projected and key in PROJECTED else self.y(key, best)
            drawn = key not in RATES or y  # (a budget without a rate is not on the rate's curve)
            self.chosen[key].setData([self.x(best)] if drawn else [], [y] if drawn else [])
            self.marks[key].setValue(self.x(best))
            self.marks[key].show()
        if self.projected:
            fastest = min(p.projected_completion_s for p in self.result.points)
            bw = best.records[0].timings["projected"].get("bandwidths") or {}
            self.summary.setText(
                f"Recommended: {human_bytes(best.budget_bytes)} of experts on the device (budget share "
                f"{best.fraction:.0%}{where}), by the completion time projected for the simulated card (PCIe "
                f"{bw.get('pcie_bytes_per_s', 0) / 1e9:.0f} GB/s, HBM {bw.get('hbm_bytes_per_s', 0) / 1e9:.0f} GB/s "
                f"assumed): {duration_text(best.projected_completion_s)} (fastest {duration_text(fastest)}, "
                f"margin {margin * 100:g}%), {decode_rate(best.projected_decode_tokens_per_s)} projected; measured on "
                f"this machine {duration_text(best.completion_s)}, {decode_rate(best.decode_tokens_per_s)} (the "
                f"simulated device computes the card's experts on the CPU); device peak "
                f"{human_bytes(best.peak_device_bytes)}, RAM peak {human_bytes(best.peak_rss_bytes)}.")
        else:
            fastest = min(p.completion_s for p in self.result.points)
            self.summary.setText(
                f"Recommended: {human_bytes(best.budget_bytes)} of experts on the device (budget share "
                f"{best.fraction:.0%}{where}), completion {duration_text(best.completion_s)} (fastest "
                f"{duration_text(fastest)}, margin {margin * 100:g}%), {decode_rate(best.decode_tokens_per_s)}, "
                f"device peak {human_bytes(best.peak_device_bytes)}, RAM peak {human_bytes(best.peak_rss_bytes)}.")
        if chosen.tie:  # beyond the margin, or within it: the repeats cannot tell the two apart
            self.summary.setText(f"{self.summary.text()} A tie with the fastest, at budget share "
                                 f"{chosen.fastest.fraction:.0%}: {chosen.tie_reason}.")
        if chosen.passed_over:  # (the host tier's granule-rounded mappings, whole layers)
            self.summary.setText(
                f"{self.summary.text()} The least device peak of the budgets within the margin of the fastest: smaller "
                f"budgets within it hold more on the device ({chosen.passed_over_text}).")
        if best.routing_agreement is not None:  # a smaller budget drops more: what this one costs in answers
            self.summary.setText(f"{self.summary.text()} Approximate routing: "
                                 f"{agreement_text(best.routing_agreement, best.compared_tokens)}.")
        self.save_button.setEnabled(True)
        if not self.name.text().strip():
            self.name.setText(f"sweep {human_bytes(best.budget_bytes)}")

    def save(self, name: str | None = None):
        """Save the recommended budget (on top of the configuration the sweep started from)."""
        name = (name if name is not None else self.name.text()).strip()
        if self.recommended is None or self.result is None:
            return None
        if not name:
            self.failed.emit("Give the configuration a name first.")
            return None
        try:
            config = OffloadConfig.from_entries(self.result.base_entries).updated(
                device_expert_bytes=self.recommended.budget_bytes)
            # the layer split and the decode path (this app's own settings, not onnxruntime keys) saved beside the
            # entries, and said in the note
            split = self.recommended.split or self.result.layer_split
            own = [f"the {setting} {dict(choices)[mode]}" for setting, choices, mode in
                   (("Layer split", SPLITS, split), ("Cold experts", PATHS, self.result.decode_path)) if mode != "auto"]
            path = save_configuration(name, self.result.model_folder, config,
                                      note=self.recommendation.note + (f"; with {' and '.join(own)}" if own else ""),
                                      path=self.configurations_path,
                                      own={"layer_split": split, "decode_path": self.result.decode_path})
        except Exception as exc:
            self.failed.emit(f"Could not save the configuration '{name}': {one_line(exc)}")
            return None
        self.bar.status.setText(f"Saved configuration '{name}' in {path}.")
        return path
