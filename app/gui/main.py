"""Start the window."""

from __future__ import annotations

import sys


def run_gui(model: str | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from app.gui.main_window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("MoE Workbench")
    app.setDesktopFileName("moe-workbench")
    window = MainWindow()
    window.show()
    if model:
        window.load_model(model)
    else:
        window.load_demo()
    return app.exec()
