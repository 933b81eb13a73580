"""Named offload configurations saved under the user's data folder (e.g. a sweep's recommendation)."""

from __future__ import annotations

import json
from pathlib import Path

import platformdirs

from engine.offload.config import OffloadConfig


def default_path() -> Path:
    return Path(platformdirs.user_data_dir("moe-workbench")) / "configurations.json"


def save_configuration(name: str, model_folder: str, config: OffloadConfig, note: str = "",
                       path: Path | None = None) -> Path:
    path = path or default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(path.read_text()) if path.is_file() else {}
    saved[name] = {"model": str(model_folder), "entries": config.to_entries(), "note": note}
    path.write_text(json.dumps(saved, indent=2) + "\n")
    return path


def load_configuration(name: str, path: Path | None = None) -> tuple[str, OffloadConfig]:
    path = path or default_path()
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if name not in saved:
        raise KeyError(f"no saved configuration '{name}' in {path}")
    return saved[name]["model"], OffloadConfig.from_entries(saved[name]["entries"])
