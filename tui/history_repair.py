"""A damaged chat history: keep it as a backup, start afresh, and salvage what can still be read.

`recover` renames the damaged `history.sqlite3` (and its `-wal`/`-shm` journal files, which belong to it) to
`history.sqlite3.corrupt-<time>` beside it, never overwriting a file, opens a fresh database in its place and
copies into it every chat, message and setting that SQLite can still read from a scratch copy of the backup
(the backup itself is never opened for writing). Rows are read table by table; where a whole-table read
fails, rowid ranges are read by bisection, so only the rows on damaged pages are lost.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .history_base import CANCELLED, DONE, ERROR, INTERRUPTED, STREAMING, HistoryError

JOURNALS = ("-wal", "-shm")
MAX_QUERIES = 20_000  # bisection reads per table, so a badly damaged file cannot keep the chat from starting
MAX_ROWID = 2**40  # where bisection starts when even the largest rowid cannot be read
RECOVERED_TITLE = "Recovered messages"
_STATUSES = {DONE, CANCELLED, ERROR, INTERRUPTED, STREAMING}


@dataclass(frozen=True)
class Recovery:
    """What `recover` did: where the damaged file went and what the fresh history holds from it."""

    backup: Path
    reason: str
    chats: int
    messages: int
    settings: int
    salvage_problem: Optional[str] = None  # why nothing was salvaged, when copying failed

    def note(self) -> str:
        """One line for the user."""
        if self.salvage_problem:
            saved = f"nothing was recovered from it: {self.salvage_problem}"
        elif self.chats or self.messages:
            saved = f"recovered {self.chats} chat(s) and {self.messages} message(s) from it"
        else:
            saved = "nothing in it could be read"
        return (f"The chat history was damaged; it is kept as {self.backup} and a fresh history was started "
                f"({saved}).")


def backup_name(path: Path, when: Optional[float] = None) -> Path:
    """`<name>.corrupt-<YYYYmmdd-HHMMSS>` beside `path`, with a counter when that name (or a journal of it)
    already exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    for n in range(1, 1000):
        candidate = path.with_name(f"{path.name}.corrupt-{stamp}" + (f"-{n}" if n > 1 else ""))
        if not any(Path(str(candidate) + suffix).exists() for suffix in ("", *JOURNALS)):
            return candidate
    raise HistoryError(f"too many backups of {path} in {path.parent}; move some away")


def _move(src: Path, dst: Path) -> None:
    """Rename without ever replacing an existing file."""
    try:
        os.link(src, dst)  # fails if dst exists
        os.unlink(src)
    except FileExistsError:
        raise
    except OSError:  # no hard links here: check, then rename
        if dst.exists():
            raise FileExistsError(dst) from None
        os.rename(src, dst)


def set_aside(path: Path) -> Path:
    """Move the damaged database and its journal files to a backup name; returns the backup's path."""
    backup = backup_name(path)
    try:
        for suffix in ("", *JOURNALS):
            src = Path(str(path) + suffix)
            if src.exists():
                _move(src, Path(str(backup) + suffix))
    except OSError as e:
        raise HistoryError(f"chat history {path} is damaged and cannot be moved aside ({e.strerror or e}); "
                           f"move it away yourself, or set OFFSPEC_DATA_DIR (or --data-dir) to another "
                           f"directory") from None
    return backup


def _rows(db: sqlite3.Connection, table: str, columns: str) -> list[tuple]:
    """Every readable row of `table`: one scan, else rowid ranges by bisection (damaged ranges skipped)."""
    query = f"SELECT rowid, {columns} FROM {table}"
    try:
        return db.execute(query).fetchall()
    except sqlite3.DatabaseError:
        pass
    try:
        top = int(db.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0] or 0)
    except (sqlite3.DatabaseError, TypeError, ValueError):
        top = MAX_ROWID
    found: list[tuple] = []
    ranges, queries = [(0, top)], 0
    while ranges and queries < MAX_QUERIES:
        lo, hi = ranges.pop()
        queries += 1
        try:
            found += db.execute(f"{query} WHERE rowid BETWEEN ? AND ?", (lo, hi)).fetchall()
        except sqlite3.DatabaseError:
            if lo < hi:
                mid = (lo + hi) // 2
                ranges += [(mid + 1, hi), (lo, mid)]
    return sorted(found)


def _text(value: Any) -> Optional[str]:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) else default


def salvage(damaged: Path, store) -> tuple[int, int, int]:
    """Copy the readable chats, messages and settings of the database file `damaged` into `store` (fresh).

    Reads a scratch copy, so the backup is never written. Returns (chats, messages, settings) copied."""
    with tempfile.TemporaryDirectory(prefix=".offspec-salvage-", dir=store.path.parent) as scratch:
        copy = Path(scratch) / "damaged.sqlite3"
        for suffix in ("", "-wal"):
            if Path(str(damaged) + suffix).exists():
                shutil.copyfile(str(damaged) + suffix, str(copy) + suffix)
        try:
            db = sqlite3.connect(str(copy))
        except sqlite3.Error:
            return 0, 0, 0
        try:
            tables = {name: {c[1] for c in db.execute(f"PRAGMA table_info({name})").fetchall()}
                      for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()}
            chats = _rows(db, "chats", "id, title, system_prompt, created_at, updated_at") if "chats" in tables else []
            messages, stats, reasoning, settings = [], {}, {}, []
            if "messages" in tables:
                messages = _rows(db, "messages", "id, chat_id, role, content, status, created_at")
                if "stats" in tables["messages"]:  # a version-1 file has none
                    stats = {r[1]: r[2] for r in _rows(db, "messages", "id, stats")}
                if "reasoning" in tables["messages"]:  # nor has one before version 3
                    reasoning = {r[1]: r[2] for r in _rows(db, "messages", "id, reasoning")}
            if "settings" in tables:
                settings = _rows(db, "settings", "key, value")
        except sqlite3.DatabaseError:  # the schema itself is unreadable: nothing to salvage
            return 0, 0, 0
        finally:
            db.close()
    return _insert(store, chats, messages, stats, reasoning, settings)


def _insert(store, chats: list[tuple], messages: list[tuple], stats: dict, reasoning: dict,
            settings: list[tuple]) -> tuple[int, int, int]:
    now = time.time()
    n_chats = n_messages = n_settings = 0
    with store._tx("recovering the damaged history") as db:
        chat_ids = set()
        for _rowid, cid, title, system, created, updated in chats:
            if not isinstance(cid, int) or cid in chat_ids:
                continue
            db.execute("INSERT INTO chats (id, title, system_prompt, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
                       (cid, _text(title) or f"Recovered chat {cid}", _text(system) or "", _number(created, now),
                        _number(updated, now)))
            chat_ids.add(cid)
            n_chats += 1
        orphans: dict[Any, int] = {}  # a stand-in chat per lost chat row, for the messages that survived it
        for _rowid, mid, cid, role, content, status, created in messages:
            text = _text(content)
            if not isinstance(mid, int) or role not in ("system", "user", "assistant") or text is None:
                continue
            if cid not in chat_ids:
                if cid not in orphans:
                    title = f"{RECOVERED_TITLE} ({len(orphans) + 1})"
                    orphans[cid] = int(db.execute("INSERT INTO chats (title, system_prompt, created_at, updated_at) "
                                                  "VALUES (?, '', ?, ?)", (title, now, now)).lastrowid)
                    n_chats += 1
                cid = orphans[cid]
            status = status if status in _STATUSES else DONE
            status = INTERRUPTED if status == STREAMING else status
            extra = _text(stats.get(mid)) or "{}"
            try:
                json.loads(extra)
            except ValueError:
                extra = "{}"
            db.execute("INSERT OR IGNORE INTO messages (id, chat_id, role, content, status, stats, created_at, "
                       "reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (mid, cid, role, text, status, extra, _number(created, now), _text(reasoning.get(mid)) or ""))
            n_messages += 1
        for _rowid, key, value in settings:
            if _text(key) is not None and _text(value) is not None:
                db.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (_text(key), _text(value)))
                n_settings += 1
    return n_chats, n_messages, n_settings


def recover(store_class, path: Path, reason: str):
    """Set the damaged history at `path` aside, open a fresh one there and salvage into it (see the module doc)."""
    backup = set_aside(path)
    store = store_class(path)
    try:
        counts, problem = salvage(backup, store), None
    except (sqlite3.Error, OSError, HistoryError) as e:  # the fresh history works anyway; the note says why
        counts, problem = (0, 0, 0), " ".join(str(e).split()) or type(e).__name__
    store.recovery = Recovery(backup, reason, *counts, salvage_problem=problem)
    return store
