"""A budget sweep drawn with pyqtgraph and exported as PNG or SVG (offscreen; no window needed)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.units import human_bytes


FORMATS = (".png", ".svg", ".jpg", ".jpeg", ".bmp")
RATES = {"decode_tokens_per_s"}  # the panels whose points only answers of two tokens or more give


def plot_path_problem(path: str | Path) -> str | None:
    """Why the plot could not be written at `path` (checked before a sweep runs), or None."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        return f"--plot {path}: name the file .png or .svg (or {', '.join(FORMATS[2:])})"
    if path.is_dir():
        return f"--plot {path}: a folder, not a file"
    if not path.parent.is_dir():
        return f"--plot {path}: no folder {path.parent}"
    if not os.access(path.parent, os.W_OK):
        return f"--plot {path}: the folder {path.parent} is not writable"
    return None


def export_sweep_plot(points: list[dict], recommended_budget: int, path: str | Path) -> Path:
    """points: SweepPoint.as_dict() rows. Four panels against the expert budget (GiB). On a simulated device
    (rows with projected_completion_s) the completion and decode panels also draw the values projected for the
    simulated card (orange), next to the measured ones (blue), and the recommendation (red line) follows the
    projected completion time: the panels' titles say so. Where the sweep compared layer splits (rows with
    split "whole"), the whole-layer points are squares beside the spread's line. (Not a line: a further line
    series in this export aborted the CLI's process at exit, in pyqtgraph / PySide6's teardown, on the dev VM.)"""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph as pg
    import pyqtgraph.exporters
    from PySide6.QtCore import QBuffer, QIODevice
    from PySide6.QtWidgets import QApplication

    _app = QApplication.instance() or QApplication([])
    pg.setConfigOptions(antialias=True, background="w", foreground="k")
    layout = pg.GraphicsLayoutWidget()
    layout.resize(1100, 700)
    byte_unit, byte_scale = _byte_unit(max(p["budget_bytes"] for p in points))
    rss_unit, rss_scale = _byte_unit(max(p["peak_rss_bytes"] for p in points))
    device_unit, device_scale = _byte_unit(max(p["peak_device_bytes"] for p in points))
    whole = [p for p in points if p.get("split") == "whole"]
    points = [p for p in points if p.get("split") != "whole"]  # every budget once: the spread (or the only split)
    left = sorted({p["budget_bytes"] for p in points + whole if not p["decode_tokens_per_s"]})  # no rate (RATES)
    projected = all(p.get("projected_completion_s") is not None for p in points)
    panels = (("completion time", "s", "completion_s", 1), ("decode", "tokens/s", "decode_tokens_per_s", 1),
              ("device memory peak", device_unit, "peak_device_bytes", device_scale),
              ("process RSS peak", rss_unit, "peak_rss_bytes", rss_scale))
    for index, (title, unit, key, scale) in enumerate(panels):
        with_projection = projected and key in ("completion_s", "decode_tokens_per_s")
        if with_projection:
            title += ("<br><span style='font-size:9pt'>blue measured, orange projected for the simulated card"
                      + ("; red: recommended by the projected time" if key == "completion_s" else "") + "</span>")
        elif key == "completion_s":
            title += "<br><span style='font-size:9pt'>red: the recommended budget</span>"
        if whole:
            title += "<br><span style='font-size:9pt'>squares: the budget on whole layers</span>"
        if key in RATES and left:
            # (short: a title sets its column's width) one token an answer, the prefill's: no decode step to time
            title += (f"<br><span style='font-size:9pt'>left out, one-token answers: "
                      f"{', '.join(map(human_bytes, left))}</span>")
        plot = layout.addPlot(row=index // 2, col=index % 2, title=title)
        if key in RATES and left:  # on the other panels' budget axis, from the budgets it leaves out
            budgets = [p["budget_bytes"] / byte_scale for p in points + whole]
            plot.setXRange(min(budgets), max(budgets))
        plot.setLabel("bottom", f"expert budget, device_expert_bytes ({byte_unit})")
        if unit == "s":
            plot.setLabel("left", units="s")  # pyqtgraph's own prefix: ms where the times are short
        else:
            plot.setLabel("left", unit)
            plot.getAxis("left").enableAutoSIPrefix(False)  # the unit is scaled already: no "(x0.001)"
        plot.showGrid(x=True, y=True, alpha=0.3)

        def series(rows: list[dict], name: str) -> tuple[list[float], list[float]]:
            # a budget whose answers were one token each has no decode rate: left out, not drawn at 0 tok/s
            drawn = [p for p in rows if p[name]] if key in RATES else rows
            return [p["budget_bytes"] / byte_scale for p in drawn], [(p[name] or 0) / scale for p in drawn]

        plot.plot(*series(points, key), pen=pg.mkPen("#1f6feb", width=2), symbol="o", symbolBrush="#1f6feb")
        if with_projection:
            plot.plot(*series(points, f"projected_{key}"), pen=pg.mkPen("#e36209", width=2), symbol="t",
                      symbolBrush="#e36209")
        if whole:
            plot.plot(*series(whole, key), pen=None, symbol="s", symbolBrush="#1f6feb")
            if with_projection:
                plot.plot(*series(whole, f"projected_{key}"), pen=None, symbol="s", symbolBrush="#e36209")
        plot.addItem(pg.InfiniteLine(recommended_budget / byte_scale, angle=90,
                                     pen=pg.mkPen("#d1242f", width=2, style=pg.QtCore.Qt.PenStyle.DashLine)))
    layout.show()
    _app.processEvents()
    path = Path(path)
    # drawn into memory and written here: Qt's writers say a failure (a full disk, a file that cannot be written over)
    # only on their own stderr, and an earlier sweep's file left there would read as this one's
    drawn = QBuffer()
    drawn.open(QIODevice.OpenModeFlag.WriteOnly)
    if path.suffix.lower() == ".svg":
        # pyqtgraph's own SVG exporter trips over some items; Qt's SVG painter draws the widget as is.
        from PySide6.QtCore import QRect, QSize
        from PySide6.QtGui import QPainter
        from PySide6.QtSvg import QSvgGenerator

        generator = QSvgGenerator()
        generator.setOutputDevice(drawn)
        generator.setSize(QSize(layout.width(), layout.height()))
        generator.setViewBox(QRect(0, 0, layout.width(), layout.height()))
        generator.setTitle("MoE Workbench budget sweep")
        # the axes are pictures recorded at the window's dpi: at the generator's own 72 they were drawn at 3/4 of the
        # curves' scale, their ticks' values off the points
        generator.setResolution(layout.logicalDpiX())
        painter = QPainter(generator)
        layout.render(painter)
        painter.end()
    else:
        exporter = pg.exporters.ImageExporter(layout.scene())
        exporter.parameters()["width"] = 1100
        exporter.export(toBytes=True).save(drawn, path.suffix[1:].upper())
    layout.close()
    path.write_bytes(bytes(drawn.data()))  # an OSError naming the file and why
    return path


def _byte_unit(largest: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1
