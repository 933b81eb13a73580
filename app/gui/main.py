"""Start the window: `moe-workbench` (the demo model) or `moe-workbench gui MODEL`."""

from __future__ import annotations

import os
import sys

from engine.errors import WorkbenchError
from engine.model_folder import folder_path


def display_problem(environ=None, platform: str = sys.platform) -> str | None:
    """Why the window cannot open here (Linux with no display and no Qt platform chosen), else None. Qt itself
    aborts the process in that case, with a hint about reinstalling."""
    env = os.environ if environ is None else environ
    if not platform.startswith("linux") or env.get("QT_QPA_PLATFORM"):
        return None
    if env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"):
        return None
    return ("no display to open the window on (neither DISPLAY nor WAYLAND_DISPLAY is set); the commands inspect, "
            "generate, record, sweep and contention work without one (moe-workbench --help)")


def _report_errors_in(window) -> None:
    """An exception escaping a slot becomes a message in the window (and a traceback on stderr)."""
    import traceback

    previous = sys.excepthook

    def hook(kind, value, tb):
        traceback.print_exception(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        first = str(value).strip().splitlines()[0] if str(value).strip() else ""
        try:
            window.show_error(f"Internal error (the window goes on): {kind.__name__}: {first}")
        except Exception:
            pass

    sys.excepthook = hook


def run_gui(model: str | None = None) -> int:
    problem = display_problem()
    if problem:
        raise WorkbenchError(problem)
    if model:
        folder_path(model)  # a wrong path said on the command line, before the window opens
    from PySide6.QtWidgets import QApplication

    from app.gui.main_window import MainWindow, app_icon

    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("MoE Workbench")
    app.setOrganizationName("moe-workbench")
    app.setDesktopFileName("moe-workbench")  # matches packaging/moe-workbench.desktop
    app.setWindowIcon(app_icon())
    window = MainWindow()
    _report_errors_in(window)
    window.show()
    if model:
        window.load_model(model)
    else:
        window.load_demo()
    status = app.exec()
    if not window.engine_stopped:
        # The engine's thread is still inside a call that nothing interrupts (a first run's compilation): Python's
        # exit would destroy its QThread while it runs, which aborts the process. Settings and history are saved.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
