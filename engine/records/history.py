"""The history of run records in SQLite under the user's data folder; export to JSON, CSV, Markdown."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import tempfile
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np
import platformdirs

from engine.errors import WorkbenchError
from engine.records.environment import cuda_version_text
from engine.records.schema import ALL_RESIDENT, NewerRecord, RecordError, RunRecord, decode_path_run
from engine.units import human_bytes

# the history file's own schema, kept as SQLite's user_version: 1 (files written before it was kept read 0), the runs
# table with the summary columns alone; 2, with the columns of EXTRA besides, to compare runs in a spreadsheet; 3, with
# the versions of NumPy, Numba, CuPy, CUDA and the GPU driver and the popularity file's SHA-256 besides (the numbers
# depend on them); 4, with why a run on the CPU ran there where it asked for the CUDA GPU (device_fallback) besides; 5,
# with the expert budget the plan set (budget_bytes) besides the one asked (budget), and whether the process held the
# other side's model too (other_side_loaded: side by side)
HISTORY_VERSION = 5
SUMMARY = ("id", "created", "scenario", "label", "model", "device", "budget", "load_s", "ttft_s",
           "decode_tokens_per_s", "completion_s", "peak_device_bytes", "peak_rss_bytes")


def _turns_sum(key: str):
    return lambda r: sum(turn.get(key) or 0 for turn in r.turns) if r.turns else None


def _setting(key: str):
    return lambda r: r.generation.get(key) if r.generation else None


def _hit_rate(r: RunRecord) -> float | None:
    hits, misses = (sum(layer.get(key, 0) for layer in r.layers) for key in ("hits", "misses"))
    return hits / (hits + misses) if hits + misses else None


def _layer_split(r: RunRecord) -> str | None:
    split = r.offload.get("layer_split")
    return None if not split else "whole" if split.get("whole_layers") else "spread"


def _stop_strings(r: RunRecord) -> str | None:
    return json.dumps(r.generation["stop_strings"]) if r.generation else None  # a stop text may hold "|" or ","


def _gpu_driver(r: RunRecord) -> str | None:
    """The NVIDIA driver NVML named (one per machine; None where it found no GPU)."""
    drivers = {gpu["driver"] for gpu in (r.machine or {}).get("gpus") or [] if gpu.get("driver")}
    return ", ".join(sorted(drivers)) or None


# (column, SQLite type, value from a record): the columns after SUMMARY, in the exports' order; None where a record
# has no such value (an all-CPU run's device peak, a record older than the value)
EXTRA = (
    ("turns", "INTEGER", lambda r: len(r.turns)),
    ("prompt_tokens", "INTEGER", _turns_sum("prompt_tokens")),
    ("generated_tokens", "INTEGER", lambda r: r.generated_tokens),
    ("finish_reasons", "TEXT", lambda r: ",".join(turn.get("finish_reason", "") for turn in r.turns)),
    ("cancelled", "INTEGER", lambda r: int(bool(r.timings.get("cancelled")))),
    ("max_new_tokens", "INTEGER", _setting("max_new_tokens")),
    ("do_sample", "INTEGER", lambda r: int(r.generation["do_sample"]) if r.generation else None),
    ("temperature", "REAL", _setting("temperature")),
    ("top_k", "INTEGER", _setting("top_k")),
    ("top_p", "REAL", _setting("top_p")),
    ("repetition_penalty", "REAL", _setting("repetition_penalty")),
    ("seed", "INTEGER", _setting("seed")),
    ("stop_strings", "TEXT", _stop_strings),
    ("reasoning_setting", "TEXT", _setting("reasoning")),
    ("prefill_s", "REAL", lambda r: r.timings.get("prefill_s")),
    ("settle_s", "REAL", lambda r: r.timings.get("settle_s")),
    ("projected_decode_tokens_per_s", "REAL", lambda r: (r.timings.get("projected") or {}).get("decode_tokens_per_s")),
    ("projected_completion_s", "REAL", lambda r: (r.timings.get("projected") or {}).get("completion_s")),
    ("peak_process_device_bytes", "INTEGER", lambda r: r.peaks.get("process_device_bytes")),
    ("rss_start_bytes", "INTEGER", lambda r: r.peaks.get("rss_start_bytes")),
    # side by side: the process's peaks hold the other side's model too (None: not a side's run, or an older record)
    ("other_side_loaded", "INTEGER", lambda r: r.peaks.get("other_side_loaded")),
    ("pinned_bytes", "INTEGER", lambda r: r.peaks.get("pinned_bytes")),
    ("bytes_moved", "INTEGER", lambda r: r.bytes_moved),
    ("expert_hit_rate", "REAL", _hit_rate),
    # the expert budget the plan set (budget: the one asked), less where the device had less free
    ("budget_bytes", "INTEGER", lambda r: r.offload.get("budget_bytes")),
    ("placement_mode", "TEXT", lambda r: r.offload.get("placement_mode") or "cpu_only"),
    # the note why the CUDA GPU the run asked for could not be used (None where it had it, or chose the CPU)
    ("device_fallback", "TEXT", lambda r: r.offload.get("device_fallback")),
    ("dense_device", "TEXT", lambda r: (r.offload.get("dense") or {}).get("device")),
    ("layer_split", "TEXT", _layer_split),
    ("decode_path", "TEXT", lambda r: decode_path_run(r.offload)),
    ("popularity_sha256", "TEXT", lambda r: r.offload.get("popularity_sha256")),
    ("cpu_threads", "INTEGER", lambda r: (r.offload.get("cpu_threads") or {}).get("cpu_threads_in_force")),
    ("approximate_routing", "INTEGER", lambda r: int(r.approximate_routing)),
    ("routing_agreement", "REAL", lambda r: r.routing_agreement),
    ("host_others_share", "REAL", lambda r: r.host_load.get("host_others_share")),
    ("host_steal_share", "REAL", lambda r: r.host_load.get("host_steal_share")),
    ("model_type", "TEXT", lambda r: r.model.get("type")),
    ("model_sha256", "TEXT", lambda r: r.model.get("onnx_sha256")),
    ("cpu", "TEXT", lambda r: (r.machine or {}).get("cpu")),
    ("gpus", "TEXT", lambda r: ", ".join(gpu.get("name", "?") for gpu in (r.machine or {}).get("gpus") or [])),
    ("app_version", "TEXT", lambda r: (r.versions or {}).get("app")),
    ("onnxruntime_version", "TEXT", lambda r: ((r.versions or {}).get("onnxruntime") or {}).get("version")),
    ("numpy_version", "TEXT", lambda r: (r.versions or {}).get("numpy")),
    ("numba_version", "TEXT", lambda r: (r.versions or {}).get("numba")),
    ("cupy_version", "TEXT", lambda r: (r.versions or {}).get("cupy")),
    ("cuda_runtime_version", "TEXT", lambda r: cuda_version_text((r.versions or {}).get("cuda_runtime"))),
    ("cuda_driver_version", "TEXT", lambda r: cuda_version_text((r.versions or {}).get("cuda_driver"))),
    ("gpu_driver", "TEXT", _gpu_driver),
)
COLUMNS = SUMMARY + tuple(name for name, _type, _get in EXTRA)


def summary(record: RunRecord) -> dict:
    """The record's values for the columns after id."""
    t, p = record.timings, record.peaks
    entries = record.offload.get("entries", {})
    # mode=disabled offloads no expert: no expert budget applies, whatever device_expert_bytes says
    budget = (None if entries.get("session.moe.offload.mode") == "disabled"
              else str(entries.get("session.moe.offload.device_expert_bytes", "auto")))
    row = {"created": record.created, "scenario": record.scenario, "label": record.label,
           "model": record.model.get("folder"), "device": record.offload.get("device"), "budget": budget,
           "load_s": t.get("load_s"), "ttft_s": t.get("time_to_first_token_s"),
           "decode_tokens_per_s": t.get("decode_tokens_per_s"), "completion_s": t.get("completion_s"),
           "peak_device_bytes": p.get("device_bytes"), "peak_rss_bytes": p.get("rss_bytes")}
    return row | {name: get(record) for name, _type, get in EXTRA}


def device_text(row: dict) -> str:
    """A row's device as the lists give it: a run that asked for the CUDA GPU and could not have it says so beside
    "cpu" (its record's detail and the exports give the reason whole)."""
    device = row["device"] or "cpu"
    return f"{device} (CUDA GPU unusable)" if row["device_fallback"] else device


def budget_text(row: dict) -> str | None:
    """A row's expert budget as the lists give it: device_expert_bytes or "auto" as asked, an automatic one with the
    bytes the plan came to ("auto (1.2 GiB)"; a record older than them says "auto" alone); where the plan cut the bytes
    asked to what the device had free (side-by-side's B beside A), the bytes the run had, then those asked ("1.2 GiB
    (asked 2.0 GiB)"). None for an all-CPU run, and one under mode=disabled (budget None): neither budgets a device."""
    if (row["device"] or "cpu") == "cpu" or row["budget"] is None:
        return None
    asked, had = row["budget"], row["budget_bytes"]
    if not asked or asked == "auto":
        return "auto" if had is None else f"auto ({human_bytes(had)})"
    if not asked.isdigit():
        return asked
    if had is not None and had < int(asked):
        return f"{human_bytes(had)} (asked {human_bytes(int(asked))})"
    return human_bytes(int(asked))


def default_path() -> Path:
    return Path(platformdirs.user_data_dir("moe-workbench")) / "history.sqlite3"


class History:
    def __init__(self, path: str | Path | None = None, create: bool = True):
        """`create` False (only reading it): a history that is not there is an error, not a new empty file."""
        self.path = Path(path) if path else default_path()
        if self.path.is_dir():  # SQLite's own words: "unable to open database file"
            raise WorkbenchError(f"{self.path}: a folder, not a run history file: name the history's SQLite file "
                                 f"(such as {self.path / default_path().name})")
        if not create and not self.path.is_file():
            raise WorkbenchError(f"{self.path}: no run history there (record, sweep and the window save runs)")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file where one of its folders is to be, a folder this user cannot write
            raise WorkbenchError(f"{self.path}: no history made there: its folder {exc.filename} could not be made "
                                 f"({exc.strerror})") from None
        try:
            with closing(self._connect()) as db:
                self._prepare(db)
        except sqlite3.DatabaseError as exc:  # left as it is
            raise _failure(self.path, _not_opened(exc), exc) from None

    def _prepare(self, db: sqlite3.Connection) -> None:
        """Make a new file a run history, bring an older one to HISTORY_VERSION (its runs kept, their new columns
        filled from their records), refuse a newer one or another program's database."""
        if self._version(db) == HISTORY_VERSION:
            return
        db.execute("BEGIN IMMEDIATE")  # one process at a time migrates: the other finds it done
        version = self._version(db)
        if version == HISTORY_VERSION:
            return
        extra = ", ".join(f"{name} {kind}" for name, kind, _get in EXTRA)
        if version is None:
            db.execute(f"""CREATE TABLE runs (
                id INTEGER PRIMARY KEY, created TEXT, scenario TEXT, label TEXT, model TEXT, device TEXT,
                budget TEXT, load_s REAL, ttft_s REAL, decode_tokens_per_s REAL, completion_s REAL,
                peak_device_bytes INTEGER, peak_rss_bytes INTEGER, {extra}, record TEXT NOT NULL)""")
        else:
            self._migrate(db)
        db.execute(f"PRAGMA user_version = {HISTORY_VERSION}")
        db.commit()

    def _version(self, db: sqlite3.Connection) -> int | None:
        """The file's history version (None: an empty file, to be made one); a newer one, or another program's
        database, is refused."""
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        if "runs" not in tables:
            if tables or version:
                raise WorkbenchError(f"{self.path}: not a run history (another program's database: no runs table"
                                     f"{', its tables ' + ', '.join(tables) if tables else ''})")
            return None
        if version > HISTORY_VERSION:
            raise WorkbenchError(f"{self.path}: a run history of version {version}, newer than this app reads "
                                 f"({HISTORY_VERSION}): open it with a newer moe-workbench, or name another file")
        return max(version, 1)

    def _migrate(self, db: sqlite3.Connection) -> None:
        """An older version (1, or 0: unversioned) to this one: EXTRA's columns it lacks added, and all of them filled
        from each run's record; a run whose record cannot be read keeps its row, with them empty."""
        have = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
        for name, kind, _get in EXTRA:
            if name not in have:
                db.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
        names = [name for name, _kind, _get in EXTRA]
        for run_id, text in db.execute("SELECT id, record FROM runs").fetchall():
            try:
                row = summary(RunRecord.from_dict(json.loads(text)))
            except (ValueError, TypeError, AttributeError, KeyError):  # a damaged record, another schema version
                continue
            db.execute(f"UPDATE runs SET {', '.join(f'{name} = ?' for name in names)} WHERE id = ?",
                       [row[name] for name in names] + [run_id])

    def check_writable(self) -> None:
        """Refuse, before a run is measured, a history that could not save it (a read-only file, or a folder where
        SQLite cannot write its journal): found only at the save, the run measured would be lost. A write begun and
        rolled back, as a save's would begin, so it is SQLite's own answer (a check of the file's mode is not)."""
        with self._db("runs could not be saved there") as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(f"PRAGMA user_version = {HISTORY_VERSION}")
            db.rollback()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path)

    @contextmanager
    def _db(self, failed: str):
        """A connection whose SQLite failures (a page damaged past the file's header, a file another process keeps
        locked past the timeout) are one line naming the file and `failed`, what did not happen."""
        try:
            with closing(self._connect()) as db:
                yield db
        except sqlite3.Error as exc:
            raise _failure(self.path, failed, exc) from None

    def add(self, record: RunRecord) -> int:
        with self._db("the run was not saved") as db, db:
            return _insert(db, record)

    def add_all(self, records: list[RunRecord], saved: list[int]) -> None:
        """Save `records` together (one transaction: a sweep point's runs are saved whole or not at all, never some
        under ids that read as the points' before it), their ids appended to `saved`; where they cannot be, a
        WorkbenchError that says where they are kept (keep_unsaved): a run measured is not lost with the save."""
        try:
            with self._db("the run was not saved" if len(records) == 1 else "the runs were not saved") as db, db:
                ids = [_insert(db, record) for record in records]
        except WorkbenchError as exc:
            raise WorkbenchError(f"{exc}; {keep_unsaved(records)}") from None
        saved.extend(ids)

    def get(self, run_id: int) -> RunRecord:
        """The run's record; a KeyError where there is none, a RecordError where it cannot be read (a damaged page,
        a record of another schema version)."""
        try:
            with closing(self._connect()) as db:
                row = db.execute("SELECT record FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise KeyError(f"run {run_id} in {self.path}: no such run")
            record = RunRecord.from_dict(json.loads(row[0]))
            path = record.offload.get("decode_path")
            if path:  # (a record saved before it said "all resident" where none ran)
                path["in_force"] = decode_path_run(record.offload)
            return record
        except NewerRecord as exc:  # whole, not damaged: what it needs is said as it is
            raise NewerRecord(f"run {run_id} in {self.path}: {exc}") from None
        except (sqlite3.DatabaseError, ValueError) as exc:  # RecordError and JSON's errors are ValueErrors
            raise RecordError(f"run {run_id} in {self.path}: unreadable ({exc})") from None

    def rows(self, model: str | None = None, scenario: str | None = None, label: str | None = None,
             ids: list[int] | None = None) -> list[dict]:
        """Summary rows, newest first, filtered by model folder substring, scenario, label substring and ids: every
        one that matches (an export or a list that stopped at a count would leave the oldest out unsaid)."""
        clauses, params = [], []
        if model:
            clauses.append("instr(model, ?) > 0")  # a plain substring: no LIKE wildcards in folder names
            params.append(model)
        if scenario:
            clauses.append("scenario = ?")
            params.append(scenario)
        if label:
            clauses.append("instr(lower(label), lower(?)) > 0")
            params.append(label)
        if ids:
            clauses.append(f"id IN ({', '.join('?' * len(ids))})")
            params += list(ids)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._db("the runs could not be read") as db:
            found = db.execute(f"SELECT {', '.join(COLUMNS)} FROM runs {where} ORDER BY id DESC", params).fetchall()
        rows = [dict(zip(COLUMNS, row)) for row in found]
        for row in rows:  # a row saved before its record said so keeps the path in force (cpu): none ran
            if row["placement_mode"] == "all_resident":
                row["decode_path"] = ALL_RESIDENT
            if (row["device"] or "cpu") == "cpu":  # saved as "auto": no device, no budget (as the list and window say)
                row["budget"] = None
        return rows

    def export(self, fmt: str, unreadable: list[str] | None = None, **filters) -> str:
        """The rows `filters` select, in `fmt`. JSON carries whole records: one that cannot be read is left out and
        said in `unreadable` (without that list, it is an error)."""
        return self.export_rows(fmt, self.rows(**filters), unreadable)

    def export_rows(self, fmt: str, rows: list[dict], unreadable: list[str] | None = None) -> str:
        """`rows` (as rows() gives them, read already) in `fmt`, as export() gives them."""
        if fmt == "json":
            records = []
            for row in rows:
                try:
                    records.append({"id": row["id"], **self.get(row["id"]).to_dict()})
                except RecordError as exc:
                    if unreadable is None:
                        raise
                    unreadable.append(str(exc))
            return json.dumps(records, indent=2) + "\n"
        if fmt == "csv":
            out = io.StringIO()
            writer = csv.DictWriter(out, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
            return out.getvalue()
        if fmt == "markdown":
            lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
            lines += ["| " + " | ".join(_cell(c, row[c]) for c in COLUMNS) + " |" for row in rows]
            return "\n".join(lines) + "\n"
        raise ValueError(f"unknown export format '{fmt}' (json, csv, markdown)")


def keep_unsaved(records: list[RunRecord]) -> str:
    """Where runs the history could not save (a full disk, a history locked past the timeout) are kept, in words: a
    file of their own in the system's temporary folder, as `history --export json` writes runs (the history's folder,
    on the disk that filled, would refuse it too); or why they could not be."""
    runs = "the run" if len(records) == 1 else f"the {len(records)} runs"
    name = None
    try:
        handle, name = tempfile.mkstemp(prefix="moe-workbench-unsaved-runs-", suffix=".json")
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps([record.to_dict() for record in records], indent=2) + "\n")
    except OSError as exc:
        if name:  # a part written: no file that reads as the runs
            os.unlink(name)
        return f"{runs} could not be kept in a file either ({exc.strerror or exc})"
    return f"{runs} measured {'is' if len(records) == 1 else 'are'} kept in {name}"


def _insert(db: sqlite3.Connection, record: RunRecord) -> int:
    """Insert the record's row, in the caller's transaction; its id."""
    row = {name: _utf8(value) for name, value in summary(record).items()}
    cursor = db.execute(f"INSERT INTO runs ({', '.join(COLUMNS[1:])}, record) VALUES ({', '.join('?' * len(COLUMNS))})",
                        [row[name] for name in COLUMNS[1:]] + [json.dumps(record.to_dict())])
    return int(cursor.lastrowid)


def _utf8(value):
    """A text SQLite can store: a label or folder name given in bytes that are not UTF-8 (a Latin-1 terminal's "é")
    reaches Python as lone surrogates, which SQLite refuses; the column shows U+FFFD for such a byte, while the
    record's JSON keeps it escaped, as it was."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace") if isinstance(value, str) else value


def _not_opened(exc: sqlite3.DatabaseError) -> str:
    """What opening a file as the history did not do, by SQLite's error."""
    name = getattr(exc, "sqlite_errorname", "")
    if _locked(exc) or name == "SQLITE_CANTOPEN":  # CANTOPEN: a new file in a folder the user cannot write
        return "not opened"
    if name.startswith("SQLITE_READONLY"):
        return f"not brought forward to version {HISTORY_VERSION}, which it needs to be read"
    if name == "SQLITE_CORRUPT":  # a run history cut short or damaged, not another kind of file
        return "not opened: the file is damaged"
    return "not a run history"  # another file given as the history


def _locked(exc: sqlite3.Error) -> bool:
    """Another process holds the file locked past the timeout (a write of its own, a tool that opened it)."""
    return getattr(exc, "sqlite_errorname", "") in ("SQLITE_BUSY", "SQLITE_LOCKED")


def _failure(path: Path, failed: str, exc: sqlite3.Error) -> WorkbenchError:
    why = f"another process holds it locked: {exc}" if _locked(exc) else str(exc)
    return WorkbenchError(f"{path}: {failed} ({why})")


SHARES = ("expert_hit_rate", "routing_agreement", "host_others_share", "host_steal_share")


def _cell(column: str, value) -> str:
    if isinstance(value, float):  # plain, never scientific (12345.678 s read 1.235e+04 with .4g)
        if column.endswith("tokens_per_s"):
            return f"{value:.1f}"
        if column.endswith("_s") or column in SHARES:  # seconds to the millisecond, shares to a tenth of a percent
            return f"{value:.3f}"
        return np.format_float_positional(value, trim="-")  # a sampling setting, as it was given
    # a line break (a label given on the command line) would end the table's row
    return "" if value is None else " ".join(str(value).splitlines()).replace("|", "\\|")
