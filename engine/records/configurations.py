"""Named offload configurations saved under the user's data folder (e.g. a sweep's recommendation): onnxruntime's
offload entries, and beside them this app's own settings the configuration was measured with (OWN_SETTINGS: the
layer split and the decode path), which a configuration saved before them lacks: it leaves them as they are."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import platformdirs

from engine.errors import WorkbenchError, not_written, one_line
from engine.offload.config import PATH_KEYS, OffloadConfig
from engine.offload.decode_path import MODES as PATH_MODES
from engine.offload.layer_split import MODES as SPLIT_MODES

OWN_SETTINGS = {"layer_split": SPLIT_MODES, "decode_path": PATH_MODES}  # each setting's values


def default_path() -> Path:
    return Path(platformdirs.user_data_dir("moe-workbench")) / "configurations.json"


def _saved(path: Path) -> dict:
    """Every configuration saved in `path` ({} where there is no file yet)."""
    try:
        saved = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise WorkbenchError(f"{path}: not readable as saved configurations ({one_line(exc)})") from None
    if not isinstance(saved, dict):
        raise WorkbenchError(f"{path}: not readable as saved configurations (not a JSON object of named ones)")
    return saved


def _well_formed(item) -> bool:
    """A saved configuration as save_configuration writes it: its model folder and its entries (a hand-edited file
    may hold anything)."""
    return isinstance(item, dict) and isinstance(item.get("model"), str) and isinstance(item.get("entries"), dict)


def check_saved(path: Path | None = None, name: str | None = None, model_folder: str | Path | None = None) -> None:
    """A WorkbenchError where the saved configurations cannot be read, or where `name` is saved there for another
    model than `model_folder`: a sweep that is to save its recommendation says so before it runs, not after."""
    path = path or default_path()
    saved = _saved(path)
    if name is not None:
        _check_name(saved, name, model_folder, path)


def _check_name(saved: dict, name: str, model_folder: str | Path, path: Path) -> None:
    """A WorkbenchError where `name` holds a configuration of another model (or one not readable as any model's):
    saved under it, this one would replace that without a word."""
    item = saved.get(name)
    if item is None or (_well_formed(item) and Path(item["model"]).resolve() == Path(model_folder).resolve()):
        return
    owner = item["model"] if _well_formed(item) else "no model folder it names"
    raise WorkbenchError(f"{path}: a configuration '{name}' is saved there already, for {owner}: give this one "
                         "another name")


@contextmanager
def _locked(path: Path):
    """Saves from two processes at once, one after the other (a lock file beside `path`; POSIX only: elsewhere the
    atomic replace still keeps the file whole, but one of two saves at the same moment may be lost)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def save_configuration(name: str, model_folder: str, config: OffloadConfig, note: str = "",
                       path: Path | None = None, own: dict[str, str] | None = None) -> Path:
    """`own`: the OWN_SETTINGS the configuration ran with, saved beside its entries."""
    path = path or default_path()
    own = {key: value for key, value in (own or {}).items() if value is not None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where one of its folders is to be, a folder this user cannot write
        raise WorkbenchError(f"{path}: not saved: its folder {exc.filename} could not be made "
                             f"({exc.strerror})") from None
    # a relative path names a file from the folder it was tuned in; a later run (the window, another folder) has its own
    config = config.updated(**{key: os.path.abspath(getattr(config, key)) for key in PATH_KEYS if getattr(config, key)})
    written = None  # the file written beside it, removed where the save fails
    try:
        with _locked(path):
            saved = _saved(path)
            _check_name(saved, name, model_folder, path)
            saved[name] = {"model": str(model_folder), "entries": config.to_entries(), "note": note, **own}
            # written beside it and renamed over it: a reader never sees half a file
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".new",
                                             delete=False) as out:
                written = Path(out.name)
                out.write(json.dumps(saved, indent=2) + "\n")
            os.replace(written, path)
    except OSError as exc:  # a folder this user cannot write, a full disk
        if written is not None:
            written.unlink(missing_ok=True)
        raise WorkbenchError(f"{path}: not saved ({not_written(exc, path)})") from None
    return path


def configurations_for(model_folder: str | Path, path: Path | None = None) -> dict[str, dict]:
    """The saved configurations of one model folder: {name: {"model", "entries", "note"}}; a WorkbenchError saying why
    where the file cannot be read."""
    saved = _saved(path or default_path())
    folder = Path(model_folder).resolve()
    return {name: item for name, item in saved.items() if _well_formed(item) and Path(item["model"]).resolve() == folder}


def own_problem(item: dict) -> str | None:
    """What is wrong with the OWN_SETTINGS a saved configuration holds (a hand-edited file), or None."""
    for key, choices in OWN_SETTINGS.items():
        if key in item and item[key] not in choices:
            return f"{key} {item[key]!r} is not one of {', '.join(choices)}"
    return None


def own_of(item: dict) -> dict[str, str]:
    """The OWN_SETTINGS a saved configuration holds (own_problem vets their values)."""
    return {key: item[key] for key in OWN_SETTINGS if key in item}


def own_settings(item: dict, path: Path, name: str) -> dict[str, str]:
    """The OWN_SETTINGS a saved configuration holds; a WorkbenchError naming the value where one is not a choice."""
    problem = own_problem(item)
    if problem:
        raise WorkbenchError(f"{path}: configuration '{name}': {problem}")
    return own_of(item)


def load_configuration(name: str, path: Path | None = None) -> tuple[str, OffloadConfig, dict[str, str]]:
    """(model folder, offload configuration, the OWN_SETTINGS saved with it) saved under `name`."""
    path = path or default_path()
    saved = _saved(path)
    if name not in saved:
        known = ", ".join(sorted(saved)) or "none saved yet"
        raise WorkbenchError(f"no saved configuration '{name}' in {path} (saved: {known})")
    item = saved[name]
    if not _well_formed(item):
        raise WorkbenchError(f"{path}: configuration '{name}' is not a model folder and its offload entries")
    try:
        config = OffloadConfig.from_entries(item["entries"])
    except WorkbenchError as exc:
        raise WorkbenchError(f"{path}: configuration '{name}': {exc}") from None
    return item["model"], config, own_settings(item, path, name)
