"""Light and dark: follow the system scheme (Qt >= 6.5 styleHints().colorScheme()) unless the user
picks one; every custom-painted widget and pyqtgraph plot takes its colours from `Theme`."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication


@dataclass(frozen=True)
class Theme:
    dark: bool
    background: str
    surface: str
    text: str
    muted: str
    grid: str
    accent: str       # this process, resident experts
    others: str       # other processes
    free: str         # free / available
    tokens: str       # tokens per second
    warn: str
    error: str
    cold: str         # cold experts
    miss: str         # traffic on cold experts


LIGHT = Theme(False, background="#ffffff", surface="#f4f5f7", text="#1f2328", muted="#656d76", grid="#d0d7de",
              accent="#2f6feb", others="#d9822b", free="#9aa5b1", tokens="#1a7f37", warn="#9a6700",
              error="#cf222e", cold="#d3d8de", miss="#d1242f")
DARK = Theme(True, background="#1e1f22", surface="#2b2d31", text="#e6e6e6", muted="#9da5ad", grid="#3d4148",
             accent="#4c8dff", others="#f0a030", free="#6b7480", tokens="#3fb950", warn="#d29922",
             error="#f85149", cold="#34373c", miss="#ff6b5e")


def system_is_dark(app: QApplication) -> bool:
    scheme = app.styleHints().colorScheme()
    if scheme == Qt.ColorScheme.Dark:
        return True
    if scheme == Qt.ColorScheme.Light:
        return False
    # No answer from the platform: what its own style would draw (our palette may be set already).
    return app.style().standardPalette().color(QPalette.ColorRole.Window).lightness() < 128


def _dark_palette() -> QPalette:
    p = QPalette()
    roles = QPalette.ColorRole
    colors = {
        roles.Window: "#25272b", roles.WindowText: "#e6e6e6", roles.Base: "#1e1f22", roles.AlternateBase: "#2b2d31",
        roles.ToolTipBase: "#2b2d31", roles.ToolTipText: "#e6e6e6", roles.Text: "#e6e6e6", roles.Button: "#2f3136",
        roles.ButtonText: "#e6e6e6", roles.BrightText: "#ffffff", roles.Highlight: "#2f6feb",
        roles.HighlightedText: "#ffffff", roles.Link: "#6ea8ff", roles.PlaceholderText: "#80868e",
        roles.Light: "#3a3d42", roles.Midlight: "#33363b", roles.Mid: "#2a2c30", roles.Dark: "#18191b", roles.Shadow: "#000000",
    }
    for role, value in colors.items():
        p.setColor(role, QColor(value))
    for role in (roles.WindowText, roles.Text, roles.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6b7078"))
    return p


def apply(app: QApplication, choice: str = "system") -> Theme:
    """choice: 'system', 'light' or 'dark'. Sets the application palette; returns the theme."""
    dark = system_is_dark(app) if choice == "system" else choice == "dark"
    if app.style().name().lower() != "fusion":
        app.setStyle("Fusion")
    app.setPalette(_dark_palette() if dark else app.style().standardPalette())
    return DARK if dark else LIGHT


def current() -> Theme:
    app = QApplication.instance()
    if app is None:
        return LIGHT
    return DARK if app.palette().color(QPalette.ColorRole.Window).lightness() < 128 else LIGHT
