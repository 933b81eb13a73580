"""Start the window: `moe-workbench` (the demo model) or `moe-workbench gui MODEL`."""

from __future__ import annotations

import ctypes
import os
import sys

from engine.errors import WorkbenchError
from engine.model_folder import folder_path


# The X libraries Qt's xcb platform plugin loads that a machine without a desktop may lack (Qt's X11 requirements)
XCB_LIBRARIES = ("libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-image.so.0", "libxcb-keysyms.so.1",
                 "libxcb-render-util.so.0", "libxcb-shape.so.0", "libxcb-xkb.so.1", "libxkbcommon-x11.so.0")
# The libraries Qt's GUI modules link that PySide6's wheel does not bring (nor a Debian system's required packages), on
# every platform (offscreen too), with their Debian packages: a desktop has them, a slim container not
QT_LIBRARIES = {"libEGL.so.1": "libegl1", "libGL.so.1": "libgl1", "libX11.so.6": "libx11-6",
                "libdbus-1.so.3": "libdbus-1-3", "libfontconfig.so.1": "libfontconfig1",
                "libfreetype.so.6": "libfreetype6", "libxkbcommon.so.0": "libxkbcommon0",
                "libglib-2.0.so.0": "libglib2.0-0", "libgthread-2.0.so.0": "libglib2.0-0"}
WITHOUT_A_WINDOW = "the commands inspect, generate, record, sweep and contention work without one (moe-workbench --help)"


def _loadable(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def debian_package(library: str) -> str:
    """The Debian package of a shared library, by Debian's naming: libxcb-icccm.so.4 -> libxcb-icccm4,
    libxkbcommon-x11.so.0 -> libxkbcommon-x11-0."""
    name, version = library.split(".so.")
    return f"{name}{'-' if name[-1].isdigit() else ''}{version}"


def x_display_reachable(display: str) -> bool:
    """Whether an X client can connect to `display` (libxcb's own connect, as Qt's xcb plugin does); True where
    libxcb cannot be loaded (Qt then fails on it first)."""
    try:
        xcb = ctypes.CDLL("libxcb.so.1")
    except OSError:
        return True
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    connection = xcb.xcb_connect(display.encode(), None)  # never NULL: a failed one is an error connection
    failed = xcb.xcb_connection_has_error(connection)
    xcb.xcb_disconnect(connection)
    return failed == 0


def display_problem(environ=None, platform: str = sys.platform, loadable=_loadable,
                    reachable=x_display_reachable) -> str | None:
    """Why the window cannot open here, else None: Linux with no display and no Qt platform chosen, an X display
    whose libraries Qt's xcb plugin needs are missing, or one no X server answers at. Qt itself aborts the process in
    those cases, with a hint about reinstalling."""
    env = os.environ if environ is None else environ
    platform_chosen = env.get("QT_QPA_PLATFORM")
    if not platform.startswith("linux") or platform_chosen not in (None, "", "xcb"):
        return None
    if not platform_chosen and env.get("WAYLAND_DISPLAY"):
        return None
    if not env.get("DISPLAY"):
        if platform_chosen:
            return f"QT_QPA_PLATFORM=xcb asks for an X display and DISPLAY is not set; {WITHOUT_A_WINDOW}"
        return f"no display to open the window on (neither DISPLAY nor WAYLAND_DISPLAY is set); {WITHOUT_A_WINDOW}"
    missing = [library for library in XCB_LIBRARIES if not loadable(library)]
    if missing:
        return (f"the window needs X libraries that are not installed: {', '.join(missing)} (Debian, Ubuntu: apt "
                f"install {' '.join(map(debian_package, missing))}); {WITHOUT_A_WINDOW}")
    display = env.get("DISPLAY", "")
    if not reachable(display):
        return (f"cannot connect to the X display '{display}' that DISPLAY names (no X server answers there, or this "
                f"user may not use it); {WITHOUT_A_WINDOW}")
    return None


def qt_library_problem(platform: str = sys.platform, loadable=_loadable) -> str | None:
    """The libraries Qt's GUI module needs that are not installed, in one line, else None (importing it said only the
    first, as an internal error)."""
    missing = [library for library in QT_LIBRARIES if platform.startswith("linux") and not loadable(library)]
    if not missing:
        return None
    return (f"the window needs libraries Qt links that are not installed: {', '.join(missing)} (Debian, Ubuntu: apt "
            f"install {' '.join(dict.fromkeys(QT_LIBRARIES[library] for library in missing))}); {WITHOUT_A_WINDOW}")


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
    problem = display_problem() or qt_library_problem()
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
