"""The placement view: a layers × experts heatmap of the loaded model, updated live while it
generates. Residency shows which experts sit on the device (and which cold ones routing hits now);
traffic shows how much routing each expert gets, blue where it is a hit, red where it is a miss.
A tooltip names every cell."""

from __future__ import annotations

import math

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import (QButtonGroup, QHBoxLayout, QLabel, QRadioButton, QSizePolicy, QToolTip, QVBoxLayout,
                               QWidget)

from app.gui import theme
from engine.units import human_bytes

RECENT_MISS = 0.05   # a cold expert with at least this much decayed routing counts as missed recently


def _mix(a: QColor, b: QColor, f: float) -> QColor:
    f = max(0.0, min(1.0, f))
    return QColor(round(a.red() + (b.red() - a.red()) * f), round(a.green() + (b.green() - a.green()) * f),
                  round(a.blue() + (b.blue() - a.blue()) * f))


class Heatmap(QWidget):
    LEFT = 34
    RIGHT = 46
    TOP = 14

    def __init__(self, parent=None):
        super().__init__(parent)
        self.data: dict | None = None
        self.mode = "residency"
        self.setMouseTracking(True)
        self.setMinimumHeight(80)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setAccessibleName("Expert placement heatmap")

    def sizeHint(self) -> QSize:
        return QSize(600, 200)

    def set_data(self, data: dict | None) -> None:
        self.data = data
        self.update()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.update()

    def _grid(self):
        rows = len(self.data["resident"])
        cols = max((len(r) for r in self.data["resident"]), default=1)
        w = max(1.0, self.width() - self.LEFT - self.RIGHT)
        h = max(1.0, self.height() - self.TOP - 2)
        cell_w = min(w / cols, 40.0)
        cell_h = min(h / max(1, rows), 28.0)
        return rows, cols, cell_w, cell_h

    def cell_at(self, x: float, y: float) -> tuple[int, int] | None:
        if not self.data or not self.data["resident"]:
            return None
        rows, cols, cw, ch = self._grid()
        col = int((x - self.LEFT) // cw)
        row = int((y - self.TOP) // ch)
        if 0 <= row < rows and 0 <= col < len(self.data["resident"][row]) and x >= self.LEFT and y >= self.TOP:
            return row, col
        return None

    def paintEvent(self, _event) -> None:
        t = theme.current()
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(t.background))
        if not self.data or not self.data["resident"]:
            painter.setPen(QColor(t.muted))
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter,
                             "Load a model to see where its experts live and how routing uses them.")
            return
        rows, cols, cw, ch = self._grid()
        font = QFont(self.font())
        font.setPointSizeF(max(6.5, min(8.5, ch * 0.6)))
        painter.setFont(font)
        resident, traffic, layers = self.data["resident"], self.data["traffic"], self.data["layers"]
        peak = max((max(row) if row else 0.0) for row in traffic) if traffic else 0.0
        scale = math.log1p(peak) if peak > 0 else 1.0
        cold, accent, miss, bg = QColor(t.cold), QColor(t.accent), QColor(t.miss), QColor(t.background)
        gap = 1 if cw >= 4 and ch >= 4 else 0
        for r in range(rows):
            y = self.TOP + r * ch
            for c, on in enumerate(resident[r]):
                score = traffic[r][c] if r < len(traffic) and c < len(traffic[r]) else 0.0
                heat = math.log1p(score) / scale if scale else 0.0
                if self.mode == "residency":
                    colour = accent if on else cold
                else:
                    colour = _mix(cold if not t.dark else bg, accent if on else miss, 0.15 + 0.85 * heat if score > 0 else 0.0)
                rect = QRectF(self.LEFT + c * cw, y, cw - gap, ch - gap)
                painter.fillRect(rect, colour)
                if self.mode == "residency" and not on and score >= RECENT_MISS:
                    # a cold expert routing hits now: a red dot, bigger the more it is hit
                    d = max(2.0, min(cw, ch) * (0.3 + 0.5 * heat))
                    painter.setPen(Qt.PenStyle.NoPen)
                    painter.setBrush(miss)
                    painter.drawEllipse(rect.center(), d / 2, d / 2)
            painter.setPen(QColor(t.muted))
            if ch >= 8 or r % max(1, int(10 / max(ch, 1))) == 0:
                painter.drawText(QRectF(0, y, self.LEFT - 4, ch), Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                                 str(self.data["layer_index"][r]))
            stats = layers[r] if r < len(layers) else {}
            total = stats.get("hits", 0) + stats.get("misses", 0)
            if total and (ch >= 8 or r % max(1, int(10 / max(ch, 1))) == 0):
                painter.drawText(QRectF(self.LEFT + cols * cw + 4, y, self.RIGHT - 4, ch),
                                 Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, f"{stats['hits'] / total:.0%}")
        painter.setPen(QColor(t.muted))
        painter.drawText(QRectF(0, 0, self.LEFT - 4, self.TOP), Qt.AlignmentFlag.AlignRight, "layer")
        step = max(1, int(math.ceil(24 / cw)))
        for c in range(0, cols, step):
            painter.drawText(QRectF(self.LEFT + c * cw, 0, max(cw * step, 20), self.TOP), Qt.AlignmentFlag.AlignLeft, str(c))
        painter.drawText(QRectF(self.LEFT + cols * cw + 4, 0, self.RIGHT, self.TOP), Qt.AlignmentFlag.AlignLeft, "hits")
        painter.setPen(QPen(QColor(t.grid)))

    def tooltip_at(self, row: int, col: int) -> str:
        d = self.data
        on = d["resident"][row][col]
        score = d["traffic"][row][col] if row < len(d["traffic"]) and col < len(d["traffic"][row]) else 0.0
        stats = d["layers"][row] if row < len(d["layers"]) else {}
        total = stats.get("hits", 0) + stats.get("misses", 0)
        kind = "decayed routing count (~10 steps)" if d.get("placement") == "adaptive" else "routing count"
        lines = [f"Layer {d['layer_index'][row]}, expert {col}: " + ("resident on the device" if on else "cold (runs on the CPU)"),
                 f"Recent routing: {score:.2f} ({kind})" + ("" if on or score < RECENT_MISS else " — missed recently"),
                 f"Expert size: {human_bytes(d['bytes_per_expert'][row])}"]
        if total:
            lines.append(f"Layer {d['layer_index'][row]}: {stats['hits']} hits, {stats['misses']} misses "
                         f"({stats['hits'] / total:.0%} hit rate), {stats.get('swaps', 0)} swaps")
        lines.append(d["layer_names"][row])
        return "\n".join(lines)

    def mouseMoveEvent(self, event) -> None:
        cell = self.cell_at(event.position().x(), event.position().y())
        if cell is None:
            QToolTip.hideText()
            return
        QToolTip.showText(event.globalPosition().toPoint(), self.tooltip_at(*cell), self)


class PlacementView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("placementView")
        self.heatmap = Heatmap()
        self.residency = QRadioButton("Residency")
        self.traffic = QRadioButton("Traffic")
        self.residency.setChecked(True)
        self.residency.setToolTip("Resident (blue) or cold (grey) experts; red dots: cold experts routing hits now")
        self.traffic.setToolTip("How much routing each expert gets: blue = hits on resident experts, red = misses")
        group = QButtonGroup(self)
        group.addButton(self.residency)
        group.addButton(self.traffic)
        self.residency.toggled.connect(lambda on: self.heatmap.set_mode("residency" if on else "traffic"))
        self.summary = QLabel("No model loaded.")
        self.summary.setWordWrap(True)
        self.summary.setMinimumWidth(120)
        self.legend = QLabel()
        top = QHBoxLayout()
        top.addWidget(self.residency)
        top.addWidget(self.traffic)
        top.addSpacing(12)
        top.addWidget(self.summary, 1)
        top.addWidget(self.legend)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.heatmap, 1)
        self.updates = 0
        self.last_rate = 0.0
        self.apply_theme(theme.current())

    def apply_theme(self, t: theme.Theme) -> None:
        self.legend.setText(f"<span style='color:{t.accent}'>■</span> resident &nbsp; <span style='color:{t.cold}'>■</span> cold"
                            f" &nbsp; <span style='color:{t.miss}'>●</span> missed now")
        self.heatmap.update()

    def clear(self) -> None:
        self.last_rate = 0.0
        self.heatmap.set_data(None)
        self.summary.setText("No model loaded.")

    def set_stats(self, data: dict) -> None:
        self.updates += 1
        self.heatmap.set_data(data)
        layers = data["layers"]
        hits = sum(layer["hits"] for layer in layers)
        misses = sum(layer["misses"] for layer in layers)
        swaps = sum(layer["swaps"] for layer in layers)
        resident = sum(sum(row) for row in data["resident"])
        total = sum(len(row) for row in data["resident"])
        parts = [f"{resident} of {total} experts resident"]
        if hits + misses:
            parts.append(f"hit rate {hits / (hits + misses):.0%} ({hits} hits, {misses} misses)")
        parts.append(f"{swaps} swaps")
        if data.get("cpu_expert_rate"):
            self.last_rate = data["cpu_expert_rate"]
        if self.last_rate:
            parts.append(f"CPU experts read {human_bytes(int(self.last_rate))}/s in decode")
        approx = data.get("approximation") or {}
        if approx.get("dropped") or approx.get("substituted"):
            parts.append(f"approximate routing: {approx.get('dropped', 0)} dropped, {approx.get('substituted', 0)} substituted")
        self.summary.setText(" · ".join(parts))
