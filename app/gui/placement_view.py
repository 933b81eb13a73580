"""The placement view: a layers × experts heatmap of the loaded model, updated live while it
generates. Residency shows which experts sit on the device (and which cold ones are missed now);
traffic shows how much routing each expert gets, blue where it is on the device now (routing to it
hits), red where it is cold (routing to it misses). A tooltip names every cell, and beside the grid
every row's layer and hit rate (thin rows' labels are drawn every few rows). The summary line says
where the misses ran (on the CPU, copied into a spare device slot, or, with a host tier, read by
the GPU from host memory), in total and in the last step, and how full the pinned staging ring got."""

from __future__ import annotations

import math

import numpy as np

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QImage, QPainter, QTextDocument
from PySide6.QtWidgets import (QBoxLayout, QButtonGroup, QFrame, QHBoxLayout, QLabel, QRadioButton, QScrollArea,
                               QSizePolicy, QToolTip, QVBoxLayout, QWidget)

from app.gui import theme
from app.gui.estimate import slots_split
from engine.offload.decode_path import BOTH, PATH_WORDS, TIER, measured_words
from engine.offload.split_share import SHARE_WORDS, SHIFT_WORDS
from engine.units import byte_rate, counted, duration_text, human_bytes, layer_words

RECENT_MISS = 0.5    # a cold expert whose decayed routing count (x0.9 a step) is this high was routed to lately


def missed_now(data: dict, before: list[np.ndarray] | None) -> np.ndarray:
    """The cold experts missed now (routed to while cold). Adaptive placement's decayed count says it (RECENT_MISS);
    static placement's never decays, so there it is a miss the engine counted since the update before (`before`: its
    expert_misses per layer; counts lower than those started again). On a CPU-only load, none: nothing is missed."""
    if data.get("cpu_only"):
        return np.zeros_like(data["resident"])
    cold = data["valid"] & ~data["resident"]
    if data.get("placement") == "adaptive":
        return cold & (data["traffic"] >= RECENT_MISS)
    missed = np.zeros_like(cold)
    for row, layer in enumerate(data["layers"]):
        now = np.asarray(layer.get("expert_misses", ()))
        then = before[row] if before is not None and row < len(before) else None
        if then is None or then.shape != now.shape or (now < then).any():
            then = np.zeros_like(now)
        missed[row, :now.size] = now > then
    return cold & missed


class Heatmap(QWidget):
    """Cells drawn as one image built with numpy (a 48 × 128 grid is 6,144 cells: painting them one
    by one in Python would take the engine's time, since the GIL is shared). Where the experts are too many for
    the width, a cell holds several (experts_a_cell): every expert stays in the picture; where the layers are too
    many for the height, the heatmap asks for the height that gives each row MIN_CELL pixels (the view scrolls)."""

    LEFT = 34
    RIGHT = 46
    TOP = 14
    MIN_CELL = 3  # pixels: the narrowest cell a mouse can point at (narrower, a cell holds several experts)
    MIN_HEIGHT = 80

    resized = Signal()  # experts_a_cell may have changed

    def __init__(self, parent=None):
        super().__init__(parent)
        self.data: dict | None = None
        self.missed: np.ndarray | None = None  # missed_now's answer for `data`
        self.mode = "residency"
        self._image = None
        self._hover = None  # where the mouse showed a cell's tooltip: (position here, on the screen)
        self.setMouseTracking(True)
        self.setMinimumHeight(self.MIN_HEIGHT)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setAccessibleName("Expert placement heatmap")

    def sizeHint(self) -> QSize:
        return QSize(600, 200)

    def set_data(self, data: dict | None) -> None:
        before = [layer.get("expert_misses") for layer in self.data["layers"]] if self.data and data else None
        self.data = data
        self.missed = missed_now(data, before) if data else None
        rows = data["resident"].shape[0] if data else 0
        self.setMinimumHeight(max(self.MIN_HEIGHT, self.TOP + rows * self.MIN_CELL + 2))
        self.update()
        if self._hover is not None and QToolTip.isVisible():  # live while generating: said again with the new data
            self._show_tooltip(*self._hover)

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.update()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.resized.emit()

    def experts_a_cell(self) -> int:
        """1, or as many experts as a cell must hold for every expert's cell to be MIN_CELL pixels wide or more (a
        128-expert model in a 300-pixel-wide dock: 2)."""
        cols = self.data["resident"].shape[1] if self.data else 0
        fit = max(1, (self.width() - self.LEFT - self.RIGHT) // self.MIN_CELL)
        return max(1, math.ceil(cols / fit))

    def _grid(self) -> tuple[int, int, int, int]:
        """Rows (layers), columns (cells of experts_a_cell experts), and a cell's width and height in pixels."""
        rows, cols = self.data["resident"].shape
        cells = math.ceil(cols / self.experts_a_cell())
        w = max(1, self.width() - self.LEFT - self.RIGHT)
        h = max(1, self.height() - self.TOP - 2)
        return rows, cells, max(1, min(w // max(1, cells), 40)), max(1, min(h // max(1, rows), 28))

    def cell_at(self, x: float, y: float) -> tuple[int, int, int] | None:
        """The cell under (x, y): its row and the first and last of its experts (the same one where a cell holds one);
        None off the grid and on a layer's cells past its experts."""
        if not self.data or not self.data["resident"].size:
            return None
        rows, cells, cw, ch = self._grid()
        if x < self.LEFT or y < self.TOP:
            return None
        col, row = int((x - self.LEFT) // cw), int((y - self.TOP) // ch)
        if not (0 <= row < rows and 0 <= col < cells):
            return None
        per = self.experts_a_cell()
        experts = np.flatnonzero(self.data["valid"][row, col * per:(col + 1) * per]) + col * per
        return (row, int(experts[0]), int(experts[-1])) if experts.size else None

    def _per_cell(self, per: int) -> tuple[np.ndarray, ...]:
        """The grid folded into cells of `per` experts, each [rows, cells]: the share of a cell's experts on the
        device, its most routed expert's routing and whether that one is on the device, the most routing of its
        experts missed now (-1 where none is), and whether it holds any expert. With one expert a cell: the experts'
        own values."""
        resident, traffic, valid = self.data["resident"], self.data["traffic"], self.data["valid"]
        rows, cols = resident.shape
        cells = math.ceil(cols / per)
        pad = ((0, 0), (0, cells * per - cols))
        fold = lambda a: np.pad(a, pad).reshape(rows, cells, per)  # noqa: E731
        valid, resident, traffic, missed = fold(valid), fold(resident & valid), fold(traffic), fold(self.missed)
        share = resident.sum(-1) / np.maximum(1, valid.sum(-1))
        hottest = np.where(valid, traffic, -1.0).argmax(-1)[..., None]
        routed = np.take_along_axis(traffic, hottest, -1)[..., 0]
        routed_resident = np.take_along_axis(resident, hottest, -1)[..., 0]
        missed_routing = np.where(missed & valid, traffic, -1.0).max(-1)
        return share, routed, routed_resident, missed_routing, valid.any(-1)

    def _cells(self, t: theme.Theme, cw: int, ch: int) -> np.ndarray:
        """RGB pixels of the grid: [rows * ch, cells * cw, 3]. A cell of several experts is shaded by the share of
        them on the device (residency) or coloured as its most routed expert (traffic)."""
        peak = float(self.data["traffic"].max()) if self.data["traffic"].size else 0.0
        share, traffic, resident, missed_routing, valid = self._per_cell(self.experts_a_cell())
        rgb = lambda name: np.array(QColor(name).getRgb()[:3], np.float32)  # noqa: E731
        cold, accent, miss, bg = rgb(t.cold), rgb(t.accent), rgb(t.miss), rgb(t.background)
        heat_of = lambda routed: (np.log1p(np.maximum(routed, 0)) / np.log1p(peak)  # noqa: E731
                                  if peak > 0 else np.zeros_like(routed))
        heat = heat_of(traffic)
        if self.mode == "residency":
            colour = cold + (accent - cold) * share[..., None]
        else:
            base = bg if t.dark else cold
            target = np.where(resident[..., None] | bool(self.data.get("cpu_only")), accent, miss)
            mix = np.where(traffic > 0, 0.15 + 0.85 * heat, 0.0)[..., None]
            colour = base + (target - base) * mix
        colour = np.where(valid[..., None], colour, bg)
        pixels = np.repeat(np.repeat(colour, ch, axis=0), cw, axis=1)
        rows, cols = valid.shape
        if self.mode == "residency":
            # a cold expert missed now: a dot, bigger the more it is routed to
            missed = missed_routing >= 0
            if missed.any():
                radius = np.maximum(1.0, np.minimum(cw, ch) * (0.15 + 0.25 * heat_of(missed_routing)))
                yy = np.arange(ch, dtype=np.float32) - (ch - 1) / 2
                xx = np.arange(cw, dtype=np.float32) - (cw - 1) / 2
                dist = np.sqrt(yy[:, None] ** 2 + xx[None, :] ** 2)              # [ch, cw]
                dots = (dist[None, :, None, :] <= radius[:, None, :, None]) & missed[:, None, :, None]
                pixels[dots.reshape(rows * ch, cols * cw)] = miss
        if cw >= 4 and ch >= 4:  # a gap of one (device) pixel between cells
            pixels[ch - 1::ch, :] = bg
            pixels[:, cw - 1::cw] = bg
        return np.ascontiguousarray(pixels.astype(np.uint8))

    def paintEvent(self, _event) -> None:
        t = theme.current()
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(t.background))
        if not self.data or not self.data["resident"].size:
            painter.setPen(QColor(t.muted))
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter,
                             "Load a model to see where its experts live and how routing uses them.")
            return
        rows, cols, cw, ch = self._grid()
        dpr = self.devicePixelRatioF()  # cells drawn in device pixels: sharp on high-DPI screens
        pixels = self._cells(t, max(1, round(cw * dpr)), max(1, round(ch * dpr)))
        height, width = pixels.shape[:2]
        image = QImage(pixels.data, width, height, 3 * width, QImage.Format.Format_RGB888)
        image.setDevicePixelRatio(dpr)
        self._image = (pixels, image)
        painter.drawImage(self.LEFT, self.TOP, image)
        font = self.label_font()
        painter.setFont(font)
        painter.setPen(QColor(t.muted))
        every = max(1, int(math.ceil(12 / ch)))  # a label every few rows when rows are thin
        layers = self.data["layers"]
        right = self.LEFT + cols * cw
        box = max(ch, 12)
        for r in range(0, rows, every):
            # centred on its own row (a 12-pixel box from the row's top centred it two 3-pixel rows down), with a tick
            # at the row where the label spans several
            middle = self.TOP + r * ch + ch / 2
            painter.drawText(QRectF(0, middle - box / 2, self.LEFT - 4, box),
                             Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                             str(self.data["layer_index"][r]))
            if every > 1:
                painter.drawLine(QPointF(self.LEFT - 3, middle), QPointF(self.LEFT - 1, middle))
            stats = layers[r] if r < len(layers) else {}
            total = stats.get("hits", 0) + stats.get("misses", 0)
            if total and not self.data.get("cpu_only"):
                painter.drawText(QRectF(right + 4, middle - box / 2, self.RIGHT - 4, box),
                                 Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                                 f"{stats['hits'] / total:.0%}")
                if every > 1:
                    painter.drawLine(QPointF(right + 1, middle), QPointF(right + 3, middle))
        painter.drawText(QRectF(0, 0, self.LEFT - 4, self.TOP), Qt.AlignmentFlag.AlignRight, "layer")
        for x, number in self.column_labels(QFontMetricsF(font)):
            painter.drawText(QRectF(x, 0, self.LEFT + cols * cw - x, self.TOP), Qt.AlignmentFlag.AlignLeft, number)
        if not self.data.get("cpu_only"):  # the layers' hit rates (none without a device)
            painter.drawText(QRectF(self.LEFT + cols * cw + 4, 0, self.RIGHT, self.TOP), Qt.AlignmentFlag.AlignLeft,
                             "hits")

    def label_font(self) -> QFont:
        """The layer and expert numbers' font: smaller with thinner rows."""
        font = QFont(self.font())
        font.setPointSizeF(max(6.5, min(8.5, self._grid()[3] * 0.6)))
        return font

    def column_labels(self, metrics: QFontMetricsF) -> list[tuple[float, str]]:
        """The header's expert numbers, every few cells: (left edge, the cell's first expert). None runs past the
        grid's right edge, where it would run into the layers' "hits" heading ('126hits' read as a count)."""
        _, cells, cw, _ = self._grid()
        step, per = max(1, int(math.ceil(24 / cw))), self.experts_a_cell()
        return [(self.LEFT + c * cw, str(c * per)) for c in range(0, cells, step)
                if c * cw + metrics.horizontalAdvance(str(c * per)) <= cells * cw]

    def tooltip_at(self, row: int, first: int, last: int | None = None) -> str:
        """What a cell says: its layer and expert (experts `first` to `last` where a cell holds several), where they
        are, their routing and counts, then the layer's."""
        d = self.data
        last = first if last is None else last
        one = first == last
        experts = list(range(first, last + 1))
        stats = d["layers"][row] if row < len(d["layers"]) else {}
        named = f"Layer {d['layer_index'][row]}, " + (f"expert {first}" if one else f"experts {first}-{last}")
        scores = d["traffic"][row, first:last + 1]
        most = "" if one else f", most in the cell, expert {first + int(scores.argmax())}"
        routing = ("Recent routing{}: {:.2f} (decayed routing count, ~10 steps)" if d.get("placement") == "adaptive"
                   else "Routing{}: {:.2f} (routing count, not decayed)").format(most, float(scores.max()))
        size = f"Expert size: {human_bytes(d['bytes_per_expert'][row])}" + ("" if one else " each")
        counts = "This expert" if one else f"These {len(experts)} experts"
        counted_exactly = "expert_hits" in stats and last < len(stats["expert_hits"])
        hits = int(stats["expert_hits"][first:last + 1].sum()) if counted_exactly else 0
        misses = int(stats["expert_misses"][first:last + 1].sum()) if counted_exactly else 0
        if d.get("cpu_only"):
            lines = [f"{named}: on the CPU, as every expert is", routing, size]
            if counted_exactly:
                lines.append(f"{counts}: {counted(hits + misses, 'routed token')} (counted exactly)")
            return "\n".join(lines + [d["layer_names"][row]])
        on = [e for e in experts if d["resident"][row, e]]
        cold = [e for e in experts if not d["resident"][row, e]]
        missed = [e for e in experts if self.missed[row, e]]
        if one:
            where = on_device_text(d, row) if on else cold_text(d)
            missed_words = " — missed recently" if missed else ""
        else:  # which of them are where
            where = "; ".join(f"{words}: {', '.join(map(str, group))}" for words, group in
                              ((on_device_text(d, row), on), (cold_text(d), cold)) if group)
            missed_words = f" — missed recently: {', '.join(map(str, missed))}" if missed else ""
        lines = [f"{named}: {where}", routing + missed_words, size]
        if counted_exactly:
            lines.append(f"{counts}: {counted(hits, 'hit')}, {counted(misses, 'miss', 'misses')} "
                         "(routed tokens, counted exactly)")
        hit_rate = hit_rate_text(d, row)
        if hit_rate:
            lines.append(hit_rate)
        if stats.get("misses"):
            lines.append(f"Layer {d['layer_index'][row]} misses: {split_text(stats)}")
        if stats.get("routed_on_device"):
            lines.append(f"Layer {d['layer_index'][row]}: " + routed_on_device_text(d, stats))
        table = split_table(d, row)
        if table is not None:  # the row's own (layers of another expert size, or fixed tables, have their own)
            rows = table.get("split_rows")
            split_at = f", a pair split at rows {rows}" if rows and any(rows) else ""
            lines.append(f"Layer {d['layer_index'][row]}'s CPU share: {share_words(table)} when all are cold "
                         f"({table['cpu_takes']} of c cold{split_at})")
        lines.append(d["layer_names"][row])
        return "\n".join(lines)

    def row_at(self, y: float) -> int | None:
        """The row at height `y`, beside the grid as well as on it; None above or below the rows."""
        if not self.data or not self.data["resident"].size or y < self.TOP:
            return None
        rows, _, _, ch = self._grid()
        row = int((y - self.TOP) // ch)
        return row if row < rows else None

    def row_tooltip(self, row: int) -> str:
        """What a row says off its cells, for every row (thin rows' numbers and hit rates are drawn every few rows):
        its layer and hit rate, then its node."""
        d = self.data
        if d.get("cpu_only"):
            said = f"Layer {d['layer_index'][row]}: every expert on the CPU"
        else:
            said = hit_rate_text(d, row) or f"Layer {d['layer_index'][row]}: no hits or misses yet"
        return "\n".join([said, d["layer_names"][row]])

    def mouseMoveEvent(self, event) -> None:
        self._show_tooltip(event.position(), event.globalPosition().toPoint())

    def leaveEvent(self, event) -> None:
        self._hover = None
        super().leaveEvent(event)

    def _show_tooltip(self, position, on_screen) -> None:
        cell = self.cell_at(position.x(), position.y())
        row = self.row_at(position.y()) if cell is None else None
        text = self.tooltip_at(*cell) if cell is not None else self.row_tooltip(row) if row is not None else ""
        self._hover = (position, on_screen) if text else None
        if not text:
            QToolTip.hideText()
            return
        QToolTip.showText(on_screen, text, self)


def hit_rate_text(data: dict, row: int) -> str:
    """'Layer 5: 30 hits, 10 misses (75% hit rate), 16 slots filled, 0 swaps': the grid's `row`'s counts since load;
    '' before it has any."""
    stats = data["layers"][row] if row < len(data["layers"]) else {}
    total = stats.get("hits", 0) + stats.get("misses", 0)
    if not total:
        return ""
    return (f"Layer {data['layer_index'][row]}: {counted(stats['hits'], 'hit')}, "
            f"{counted(stats['misses'], 'miss', 'misses')} ({stats['hits'] / total:.0%} hit rate), "
            + placements_text(stats.get("fills", 0), stats.get("swaps", 0)))


def split_table(data: dict, row: int) -> dict | None:
    """The split table of the grid's `row` under the decode path "both" (one of copy_state's cold_split "tables"),
    else None."""
    path = (data.get("copies") or {}).get("decode_path") or {}
    if path.get("in_force") != "both":
        return None
    return next((table for table in (path.get("cold_split") or {}).get("tables") or [] if row in table["layers"]), None)


def on_device_text(data: dict, row: int) -> str:
    """Where an expert in one of the grid's `row`'s slots is: resident, or, in a layer that leaves slots to copied
    misses, in one of its slots, as the summary and where everything landed count them (an expert there may be a
    copied miss, not a resident placement chose)."""
    left = (data.get("left_to_copies") or [])[row:row + 1]
    if not left or not left[0]:
        return "resident on the device"
    slots = data["slots"][row]
    return f"on the device, in the layer's {counted(slots, 'slot')} ({slots_split(slots, left[0])})"


def cold_text(data: dict) -> str:
    """Where a decode miss on a cold expert runs, as the engine runs them now (the decode path, cpu_execution)."""
    in_force = ((data.get("copies") or {}).get("decode_path") or {}).get("in_force", "cpu")
    if in_force != "cpu":
        return f"cold (a miss is {PATH_WORDS[in_force]})"
    if data.get("cpu_execution") == "disabled":
        return "cold (a miss is copied to the device before it runs)"
    return "cold (a miss runs on the CPU, or is copied into a spare slot)"


def routed_on_device_text(data: dict, stats: dict) -> str:
    """A layer's steps routed on the device (LayerStats.routed_on_device): with every expert resident, or with the
    GPU reading the cold ones from the host tier (and under the decode path "both", the CPU computing a share)."""
    steps = stats["routed_on_device"]
    if not stats.get("misses_read"):
        return f"{steps} steps routed and computed on the device (every expert resident: no round trip to the host)"
    in_force = ((data.get("copies") or {}).get("decode_path") or {}).get("in_force")
    cold = PATH_WORDS[BOTH if in_force == BOTH else TIER]
    return f"{steps} steps routed on the device (resident experts, and cold ones {cold})"


def placements_text(fills: int, swaps: int) -> str:
    """'16 slots filled, 0 swaps': the experts placement copied into empty slots (at load, at a re-plan, or where a
    slot stood empty) apart from the residents it replaced because routing moved, what adaptive placement is judged
    by."""
    return f"{counted(fills, 'slot')} filled, {counted(swaps, 'swap')}"


def static_text(state: dict | None) -> str:
    """Static placement without a popularity file before its residents are in (engine/offload/placement.py's
    StaticPlacement): 'static placement counts routing for 20 more tokens, then places its residents' during its
    opening (the slots hold copied misses meanwhile), '12 chosen experts still to copy in' while the safe points copy
    them in; '' once they are in, and under adaptive placement (None)."""
    if not state:
        return ""
    if state["opening_tokens_left"]:
        return (f"static placement counts routing for {counted(state['opening_tokens_left'], 'more token')}, "
                f"then places its residents")
    if state["to_place"]:
        return f"static placement has {counted(state['to_place'], 'chosen expert')} still to copy in"
    return ""


def legend_text(t: theme.Theme, mode: str, cpu_only: bool = False, copies: bool = False) -> str:
    """The colours of the mode's cells (Heatmap._cells): residency, or traffic (stronger the more routing); on a
    CPU-only load, where nothing is resident or missed, the one colour of each. `copies`: placement leaves slots to
    copied misses, and a blue cell may be one (slots_text counts them apart): on the device, not resident."""
    if cpu_only:
        return (_entry(t.cold, "■", "on the CPU") if mode == "residency" else
                _entry(t.accent, "■", "routed (stronger: more routing)"))
    if mode == "residency":
        return " &nbsp; ".join([_entry(t.accent, "■", "on the device" if copies else "resident"),
                                _entry(t.cold, "■", "cold"), _entry(t.miss, "●", "missed now")])
    # the colour is where the expert is now; the routing it shows may be from before placement moved it
    return " &nbsp; ".join([_entry(t.accent, "■", "on the device now: hits"),
                            _entry(t.miss, "■", "cold now: misses"), _entry(None, "", "(stronger: more routing)")])


def _entry(colour: str | None, mark: str, words: str) -> str:
    """One of the legend's entries, kept whole where the legend wraps (a narrow dock broke Traffic's after 'cold
    now:', its 'misses' starting the next line, read as the next entry)."""
    swatch = f"<span style='color:{colour}'>{mark}</span> " if mark else ""
    return f"<span style='white-space:nowrap'>{swatch}{words}</span>"


def cells_text(per: int, mode: str, cpu_only: bool = False) -> str:
    """What a cell of the heatmap holds where it holds several experts (Heatmap.experts_a_cell) and how it is
    coloured then (Heatmap._cells); '' where a cell is one expert."""
    if per == 1:
        return ""
    if cpu_only and mode == "residency":  # every expert on the CPU: one colour
        return f"{per} experts a cell"
    return f"{per} experts a cell, " + ("shaded by the share on the device" if mode == "residency" else
                                         "coloured as its most routed")


def split_text(split: dict) -> str:
    """'12 on the CPU, 3 copied to the device (2 decode copies), 5 read by the GPU from host memory' (the last only
    with a host tier): every miss in one of the three."""
    text = (f"{split.get('misses_cpu', 0)} on the CPU, {split.get('misses_copied', 0)} copied to the device "
            f"({split.get('miss_copies', 0)} decode copies)")
    if split.get("misses_read"):
        text += f", {split['misses_read']} read by the GPU from host memory"
    return text


def slots_text(data: dict) -> str:
    """'4 of 16 experts resident', or where placement leaves slots to copied misses (adaptive placement's miss slots,
    static placement's slots its choice left: OffloadEngine.slots_left_to_copies), the experts the heatmap shows on
    the device and the slots they are in, summed over the layers as the engine holds them: '6 of 16 experts on the
    device, in 6 slots: 4 resident experts, 2 left for copied misses' (copies then fill those 2)."""
    on_device, total = int(data["resident"].sum()), int(data["valid"].sum())
    miss = sum(data.get("left_to_copies") or [])
    if not miss:
        return f"{on_device} of {total} experts resident"
    slots = sum(data["slots"])
    return f"{on_device} of {total} experts on the device, in {counted(slots, 'slot')}: {slots_split(slots, miss)}"


def copies_text(copies: dict, layer_index: list[int] | None = None) -> str:
    """What the miss policy's copies do: 'each copy earning 0.93 later hits, each placement swap earning 2.31 hits
    (or: placement's swaps paused, ...: swap_judge.py), 4 streaming slots for layers without slots, CPU misses priced
    at 64.0 GB/s + 190 µs a call' (the slots left to copies are slots_text's; later hits measured by the engine,
    absent until enough copies were made; the decode streaming slots device_working_bytes asked for; the CPU kernels'
    cost the policy weighs copies against, once measured), and
    whether the budget holds whole layers instead of being spread (engine/offload/layer_split.py), with the step
    times that chose it (or that it holds no layer whole, as where everything landed says), or which split a trial
    is timing now; the same for where decode computes cold experts (engine/offload/decode_path.py) where a host tier
    lets it choose (`layer_index`: the model's layer numbers of the engine's layers, which name the layers whose split
    tables differ)."""
    parts = []
    reuse = copies.get("later_hits_per_copy")
    if reuse is not None:
        parts.append(f"each copy earning {reuse:.2f} later hits")
    placement = copies.get("placement") or {}
    earned = placement.get("net_hits_per_swap")
    if placement.get("swaps_paused"):
        parts.append(f"placement's swaps paused (a swap earned {earned:.2f} hits lately: routing shows no recency)")
    elif earned is not None:
        parts.append(f"each placement swap earning {earned:.2f} hits")
    streaming = sum(copies.get("streaming_slots") or [])
    if streaming:
        parts.append(f"{streaming} streaming slot{'s' if streaming != 1 else ''} for layers without slots")
    rate, call = copies.get("cpu_bytes_per_s"), copies.get("cpu_call_s")
    if rate:
        parts.append(f"CPU misses priced at {byte_rate(rate, 1)}" + (f" + {duration_text(call)} a call" if call else "")
                     + clamped_words(copies, 1, with_call=True))
    split = copies.get("layer_split") or {}
    measured = split.get("measured_ms") or {}
    if split.get("measuring"):  # decode speed moves with the split for the trial's few dozen steps
        now = "whole layers" if split["measuring"] == "whole" else "the budget spread over every layer"
        parts.append(f"timing the layer split: {now} now")
    elif split.get("whole_layers") and split.get("layers_whole") == 0:  # a budget below one layer: all off the device
        parts.append("whole layers: no layer fits the expert budget")
    elif split.get("whole_layers"):
        parts.append("whole layers on the device" + (
            f" (measured {duration_text(measured['whole'] / 1e3)} a token against "
            f"{duration_text(measured['spread'] / 1e3)} spread)"
            if {"whole", "spread"} <= measured.keys() else ""))
    path = copies.get("decode_path") or {}
    measured = path.get("measured_ms") or {}
    if path.get("measuring"):  # the same for the decode path's trial
        parts.append(f"timing where cold experts run: {PATH_WORDS[path['measuring']]} now")
    elif path.get("host_tier"):
        parts.append("cold experts " + PATH_WORDS[path.get("in_force", "cpu")] + _cpu_share(path, layer_index) + (
            f" (measured a token: {measured_words(measured)})" if len(measured) > 1 else ""))
    return ", ".join(parts)


def clamped_words(state: dict, decimals: int, with_call: bool = False) -> str:
    """' (measured 140.2 GB/s, clamped to the host's streaming read)' where the CPU rate `state` prices misses at
    (OffloadEngine.cpu_rate_state) is lower than the one measured; else ''. `with_call`: where the words before say
    the fixed cost a call in force, the measured line's own beside its rate (' (measured 140.2 GB/s + 129 µs a call,
    its rate clamped ...)'): the held line's is made through the calls' mean (CpuRate.priced), and the measured rate
    beside it alone read as a line nobody measured."""
    rate, measured = state.get("cpu_bytes_per_s"), state.get("cpu_measured_bytes_per_s")
    if not rate or not measured or measured <= rate:
        return ""
    call = state.get("cpu_measured_call_s") if with_call else None
    if call:
        return (f" (measured {byte_rate(measured, decimals)} + {duration_text(call)} a call, its rate clamped to the "
                f"host's streaming read)")
    return f" (measured {byte_rate(measured, decimals)}, clamped to the host's streaming read)"


def threads_text(threads: dict) -> str:
    """'CPU experts on 6 of 8 threads: other processes keep 2.1 cores busy' where the automatic thread count
    (engine/kernel_threads.py) left cores to other processes; '' otherwise."""
    if not threads.get("cpu_threads_automatic") or threads["cpu_threads_in_force"] >= threads["cores"]:
        return ""
    return (f"CPU experts on {threads['cpu_threads_in_force']} of {threads['cores']} threads: other processes keep "
            f"{threads['others_busy_cores']:.1f} cores busy")


def _cpu_share(path: dict, layer_index: list[int] | None = None) -> str:
    """' (up to 4 of 8 when all are cold, the CPU's parts at 65 GB/s, after 190 µs of host work a layer)': the CPU's
    share under the decode path "both" (with a pair split by rows: 'up to 4 and 17% of one more of 8'; where layers'
    tables give different shares, each with its layers, as `layer_index` numbers the engine's: 'up to 4 of 8 in layers
    0-11 and 3 of 8 in layers 12-23'), and the CPU's measured rate and the host's measured work between two such
    layers, which the share is weighed with; '' elsewhere."""
    split = path.get("cold_split") or {}
    if path.get("in_force") != "both" or not split.get("cpu_takes"):
        return ""
    shares: dict[str, list[int]] = {}  # each share said, with the layers whose tables give it
    for table in split.get("tables") or [split]:  # (the first layer's alone where no table says its layers)
        numbers = [layer if layer_index is None else layer_index[layer] for layer in table.get("layers", [])]
        shares.setdefault(share_words(table), []).extend(numbers)
    said = " and ".join(words if len(shares) == 1 else f"{words} in {layer_words(sorted(layers))}"
                        for words, layers in shares.items())
    host_s = split.get("host_gap_s") or 0.0
    host = f", after {duration_text(host_s)} of host work a layer" if host_s else ""
    rate = split.get("cpu_bytes_per_s")  # what the CPU's parts measured, as the table's CPU side prices them
    rate_words = f", the CPU's parts at {byte_rate(rate, 0)}{clamped_words(split, 0)}" if rate else ""
    left_out = split.get("slow_steps_left_out") or 0  # steps slowed by other work, which the rate did not count
    if rate and left_out:
        rate_words += f" ({left_out} slow step{'s' if left_out > 1 else ''} left out)"
    share = split.get("share") or {}  # the share trials (engine/offload/split_share.py)
    rows_trial = (split.get("rows") or {}).get("measuring")  # the row trials' way timed now (split_share.py)
    if share.get("measuring"):
        trial = f", timing {SHARE_WORDS[share['measuring']]} now"
    elif rows_trial:
        trial = f", timing {rows_trial} now"
    elif share.get("shift"):
        trial = f", {SHIFT_WORDS[share['shift']]} than the rates give, as measured faster"
    else:
        trial = ""
    return f" (up to {said} when all are cold{trial}{rate_words}{host})"


def share_words(table: dict) -> str:
    """'4 of 8': the most cold pairs of a token's k that a layer's split table (copy_state's cold_split, or one of its
    "tables") gives the CPU, all being cold; '4 and 17% of one more of 8' with the CPU's rows of a pair split by
    rows."""
    takes = table["cpu_takes"]
    rows, inter = (table.get("split_rows") or [0])[-1], table.get("inter_size")
    part = f" and {1 - rows / inter:.0%} of one more" if rows and inter else ""  # the CPU's rows of the split pair
    return f"{takes[-1]}{part} of {len(takes) - 1}"


class PlacementView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("placementView")
        self.heatmap = Heatmap()
        self.residency = QRadioButton("Residency")
        self.traffic = QRadioButton("Traffic")
        self.residency.setChecked(True)
        self.residency.setToolTip("Experts on the device (resident, or in a slot left to copied misses: the legend "
                                  "and the summary say which) or cold; dots: cold experts missed now (routed "
                                  "to while cold)")
        self.traffic.setToolTip("How much routing each expert gets (stronger: more), coloured by where it is now: blue "
                                "on the device, where routing to it hits, red cold, where it misses. An expert placed "
                                "lately shows in blue the routing it missed before: its tooltip counts both.")
        group = QButtonGroup(self)
        group.addButton(self.residency)
        group.addButton(self.traffic)
        self.residency.toggled.connect(self._mode_chosen)
        self.summary = QLabel("No model loaded.")
        self.summary.setWordWrap(True)
        self.legend = QLabel()
        self.legend.setWordWrap(True)  # (unwrapped, its line held the view ~380 pixels wide or more, in Traffic ~600)
        self.cells = QLabel()  # what the grid does where it is too narrow or too short (hidden otherwise)
        self.cells.setWordWrap(True)
        self.cells.setToolTip(f"Too narrow for a cell {Heatmap.MIN_CELL} pixels wide or more for every expert: a cell "
                              "holds several, and its tooltip names them. A wider dock holds fewer a cell. Too short "
                              f"for a row {Heatmap.MIN_CELL} pixels high or more for every layer: the heatmap scrolls.")
        self.heatmap.resized.connect(self._show_cells)
        self.scroll_area = QScrollArea()  # rows the mouse can point at, every layer reached by scrolling
        self.scroll_area.setWidget(self.heatmap)
        self.scroll_area.setWidgetResizable(True)
        self.scroll_area.setFrameShape(QFrame.Shape.NoFrame)
        # experts share cells instead (Heatmap.experts_a_cell)
        self.scroll_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll_area.setMinimumHeight(Heatmap.MIN_HEIGHT)
        self.scroll_area.verticalScrollBar().rangeChanged.connect(lambda *_: self._show_cells())
        self.legend.setToolTip("Misses (routed token-expert pairs whose expert is cold) run on the CPU, or are copied "
                               "into a spare device slot and computed there when the cost model says that is faster "
                               "(and in prefill waves), or, with a host tier, are read by the GPU from page-locked "
                               "host memory (the decode path: Budgets ▸ Cold experts). 'decode copies' counts the "
                               "experts copied by the decode miss policy. 'Slots filled' counts the experts "
                               "placement copied into empty slots (at load, at a re-plan, or where a slot stood empty; "
                               "static placement's over copied misses too); 'swaps' the residents it replaced because "
                               "routing moved. "
                               "The pinned staging ring is the page-locked host memory every copy goes through "
                               "(pinned_bytes); its high-water mark is the most it held at once.")
        self.buttons = QHBoxLayout()
        self.buttons.addWidget(self.residency)
        self.buttons.addWidget(self.traffic)
        self.buttons.addStretch(1)
        self.top = QBoxLayout(QBoxLayout.Direction.LeftToRight)  # the legend beside the buttons, or under them
        self.top.addLayout(self.buttons)
        self.top.addWidget(self.legend, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(self.top)
        layout.addWidget(self.summary)  # a row of its own: in a narrow window it wraps over the whole width
        layout.addWidget(self.cells)
        layout.addWidget(self.scroll_area, 1)
        self.updates = 0
        self.last_rate = 0.0
        self.split: dict = {}           # cumulative miss split of the loaded model (engine totals)
        self.last_step: tuple[int, int, int] | None = None   # the last decoder step: misses on the CPU, copied, read
        self.pinned: dict = {}          # the pinned staging ring (OffloadEngine.pinned_info())
        self.apply_theme(theme.current())

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._place_legend()

    def _place_legend(self) -> None:
        """The legend beside the mode buttons where its line fits there, else on a row under them, wrapping over the
        view's width (beside them, a narrow dock would wrap it into a column of a word or two a line)."""
        margins = self.layout().contentsMargins()
        room = self.width() - margins.left() - margins.right() - self.buttons.sizeHint().width() - self.top.spacing()
        line = QTextDocument()
        line.setDocumentMargin(0)
        line.setDefaultFont(self.legend.font())
        line.setHtml(self.legend.text())
        beside = math.ceil(line.idealWidth()) <= room
        self.top.setDirection(QBoxLayout.Direction.LeftToRight if beside else QBoxLayout.Direction.TopToBottom)
        self.legend.setAlignment((Qt.AlignmentFlag.AlignRight if beside else Qt.AlignmentFlag.AlignLeft)
                                 | Qt.AlignmentFlag.AlignVCenter)

    def apply_theme(self, t: theme.Theme) -> None:
        self._show_legend(t)
        self.heatmap.update()

    def _mode_chosen(self, residency: bool) -> None:
        self.heatmap.set_mode("residency" if residency else "traffic")
        self._show_legend(theme.current())

    def _show_legend(self, t: theme.Theme) -> None:
        data = self.heatmap.data or {}
        self.legend.setText(legend_text(t, self.heatmap.mode, bool(data.get("cpu_only")),
                                        bool(sum(data.get("left_to_copies") or []))))
        self._place_legend()
        self._show_cells()

    def _show_cells(self) -> None:
        data = self.heatmap.data or {}
        words = [cells_text(self.heatmap.experts_a_cell(), self.heatmap.mode, bool(data.get("cpu_only")))]
        if data and self.scroll_area.verticalScrollBar().maximum() > 0:
            words.append(f"scroll for all {data['resident'].shape[0]} layers")
        self.cells.setText(" · ".join(word for word in words if word))
        self.cells.setVisible(bool(self.cells.text()))

    def clear(self) -> None:
        self.forget_rate()
        self.split, self.last_step, self.pinned = {}, None, {}
        self.heatmap.set_data(None)
        self._show_legend(theme.current())
        self.summary.setText("No model loaded.")

    def forget_rate(self) -> None:
        """The CPU experts' read rate was measured under the plan before (a re-plan, a load): none is said until
        decode measures one under this one."""
        self.last_rate = 0.0

    def set_stats(self, data: dict) -> None:
        self.updates += 1
        self.heatmap.set_data(data)
        self._show_legend(theme.current())
        layers = data["layers"]
        hits = sum(layer["hits"] for layer in layers)
        misses = sum(layer["misses"] for layer in layers)
        swaps = sum(layer["swaps"] for layer in layers)
        fills = sum(layer.get("fills", 0) for layer in layers)
        if data.get("cpu_only"):
            self.split, self.last_step, self.pinned = {}, None, {}
            self.summary.setText(" · ".join([f"All {int(data['valid'].sum())} experts run on the CPU"]
                                            + self._cpu_parts(data)))
            return
        parts = [slots_text(data)]
        if hits + misses:
            parts.append(f"hit rate since load {hits / (hits + misses):.0%} "
                         f"({counted(hits, 'hit')}, {counted(misses, 'miss', 'misses')})")
        self.split = dict(data.get("misses") or {})
        steps = data.get("step_splits") or []
        self.last_step = tuple(steps[-1]) if steps else None
        self.pinned = dict(data.get("pinned") or {})
        if self.split.get("misses"):
            parts.append("misses since load: " + split_text(self.split))
        if self.last_step is not None:
            cpu, copied, read = self.last_step
            parts.append(f"last step: {cpu} on the CPU, {copied} copied" + (f", {read} read from host memory" if read
                                                                             else ""))
        copies = copies_text(data.get("copies") or {}, data.get("layer_index"))
        if copies:
            parts.append(copies)
        parts.append("placement: " + placements_text(fills, swaps))
        static = static_text((data.get("copies") or {}).get("static_placement"))
        if static:
            parts.append(static)
        if self.pinned:
            parts.append(f"pinned ring {human_bytes(self.pinned['bytes'])}, "
                         f"high-water {human_bytes(self.pinned['high_water'])}")
        self.summary.setText(" · ".join(parts + self._cpu_parts(data)))

    def _cpu_parts(self, data: dict) -> list[str]:
        """The CPU expert kernels' threads and read rate in decode, and approximate routing's drops and substitutions,
        where there are."""
        threads = threads_text((data.get("copies") or {}).get("cpu_threads") or {})
        parts = [threads] if threads else []
        if data.get("cpu_expert_rate"):
            self.last_rate = data["cpu_expert_rate"]
        if self.last_rate:
            parts.append(f"CPU experts read {human_bytes(int(self.last_rate))}/s in decode")
        approx = data.get("approximation") or {}
        if approx.get("dropped") or approx.get("substituted"):
            parts.append(f"approximate routing: {approx.get('dropped', 0)} routed experts dropped, "
                         f"{approx.get('substituted', 0)} substituted")
        return parts
