"""The Qt window. Importing it applies app.gui.qt_workarounds (two PySide6 defects on Python 3.11)."""

from app.gui import qt_workarounds

qt_workarounds.apply()
