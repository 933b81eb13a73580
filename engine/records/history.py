"""The history of run records in SQLite under the user's data folder; export to JSON, CSV, Markdown."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
from contextlib import closing, contextmanager
from pathlib import Path

import platformdirs

from engine.errors import WorkbenchError
from engine.records.schema import RecordError, RunRecord

COLUMNS = ("id", "created", "scenario", "label", "model", "device", "budget", "load_s", "ttft_s",
           "decode_tokens_per_s", "completion_s", "peak_device_bytes", "peak_rss_bytes")


def default_path() -> Path:
    return Path(platformdirs.user_data_dir("moe-workbench")) / "history.sqlite3"


class History:
    def __init__(self, path: str | Path | None = None, create: bool = True):
        """`create` False (only reading it): a history that is not there is an error, not a new empty file."""
        self.path = Path(path) if path else default_path()
        if not create and not self.path.is_file():
            raise WorkbenchError(f"{self.path}: no run history there (record, sweep and the window save runs)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with closing(self._connect()) as db, db:
                db.execute("""CREATE TABLE IF NOT EXISTS runs (
                    id INTEGER PRIMARY KEY, created TEXT, scenario TEXT, label TEXT, model TEXT, device TEXT,
                    budget TEXT, load_s REAL, ttft_s REAL, decode_tokens_per_s REAL, completion_s REAL,
                    peak_device_bytes INTEGER, peak_rss_bytes INTEGER, record TEXT NOT NULL)""")
        except sqlite3.DatabaseError as exc:  # another file given as the history (or a damaged one): left as it is
            raise _failure(self.path, "not opened" if _locked(exc) else "not a run history", exc) from None

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
        t, p = record.timings, record.peaks
        row = (record.created, record.scenario, record.label, record.model.get("folder"),
               record.offload.get("device"), str(record.offload.get("entries", {}).get(
                   "session.moe.offload.device_expert_bytes", "auto")),
               t.get("load_s"), t.get("time_to_first_token_s"), t.get("decode_tokens_per_s"), t.get("completion_s"),
               p.get("device_bytes"), p.get("rss_bytes"), json.dumps(record.to_dict()))
        with self._db("the run was not saved") as db, db:
            cursor = db.execute(f"INSERT INTO runs ({', '.join(COLUMNS[1:])}, record) VALUES "
                                f"({', '.join('?' * (len(COLUMNS)))})", row)
            return int(cursor.lastrowid)

    def get(self, run_id: int) -> RunRecord:
        """The run's record; a KeyError where there is none, a RecordError where it cannot be read (a damaged page,
        a record of another schema version)."""
        try:
            with closing(self._connect()) as db:
                row = db.execute("SELECT record FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise KeyError(f"no run {run_id} in {self.path}")
            return RunRecord.from_dict(json.loads(row[0]))
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
        return [dict(zip(COLUMNS, row)) for row in found]

    def export(self, fmt: str, unreadable: list[str] | None = None, **filters) -> str:
        """The rows `filters` select, in `fmt`. JSON carries whole records: one that cannot be read is left out and
        said in `unreadable` (without that list, it is an error)."""
        rows = self.rows(**filters)
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
            lines += ["| " + " | ".join(_cell(row[c]) for c in COLUMNS) + " |" for row in rows]
            return "\n".join(lines) + "\n"
        raise ValueError(f"unknown export format '{fmt}' (json, csv, markdown)")


def _locked(exc: sqlite3.Error) -> bool:
    """Another process holds the file locked past the timeout (a write of its own, a tool that opened it)."""
    return getattr(exc, "sqlite_errorname", "") in ("SQLITE_BUSY", "SQLITE_LOCKED")


def _failure(path: Path, failed: str, exc: sqlite3.Error) -> WorkbenchError:
    why = f"another process holds it locked: {exc}" if _locked(exc) else str(exc)
    return WorkbenchError(f"{path}: {failed} ({why})")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value).replace("|", "\\|")
