"""Named offload configurations saved under the user's data folder (e.g. a sweep's recommendation)."""

from __future__ import annotations

import json
from pathlib import Path

import platformdirs

from engine.errors import WorkbenchError, one_line
from engine.offload.config import OffloadConfig


def default_path() -> Path:
    return Path(platformdirs.user_data_dir("moe-workbench")) / "configurations.json"


def _saved(path: Path) -> dict:
    """Every configuration saved in `path` ({} where there is no file yet)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise WorkbenchError(f"{path}: not readable as saved configurations ({one_line(exc)})") from None


def save_configuration(name: str, model_folder: str, config: OffloadConfig, note: str = "",
                       path: Path | None = None) -> Path:
    path = path or default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = _saved(path)
    saved[name] = {"model": str(model_folder), "entries": config.to_entries(), "note": note}
    path.write_text(json.dumps(saved, indent=2) + "\n")
    return path


def configurations_for(model_folder: str | Path, path: Path | None = None) -> dict[str, dict]:
    """The saved configurations of one model folder: {name: {"model", "entries", "note"}} (an unreadable file: none;
    the sweep that saves the next one says why)."""
    try:
        saved = _saved(path or default_path())
    except WorkbenchError:
        return {}
    folder = Path(model_folder).resolve()
    return {name: item for name, item in saved.items() if Path(item.get("model", "")).resolve() == folder}


def load_configuration(name: str, path: Path | None = None) -> tuple[str, OffloadConfig]:
    """(model folder, offload configuration) saved under `name`."""
    path = path or default_path()
    saved = _saved(path)
    if name not in saved:
        known = ", ".join(sorted(saved)) or "none saved yet"
        raise WorkbenchError(f"no saved configuration '{name}' in {path} (saved: {known})")
    return saved[name]["model"], OffloadConfig.from_entries(saved[name]["entries"])
