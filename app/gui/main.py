"""Start the window: `moe-workbench` (the demo model) or `moe-workbench gui MODEL`."""

from __future__ import annotations

import sys


def run_gui(model: str | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from app.gui.main_window import MainWindow, app_icon

    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("MoE Workbench")
    app.setOrganizationName("moe-workbench")
    app.setDesktopFileName("moe-workbench")  # matches packaging/moe-workbench.desktop
    app.setWindowIcon(app_icon())
    window = MainWindow()
    window.show()
    if model:
        window.load_model(model)
    else:
        window.load_demo()
    return app.exec()
