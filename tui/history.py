"""Chat history in SQLite: chats, their messages and the chat settings.

Crash safety: WAL journal with synchronous=FULL, every write in its own transaction (one commit per
message), and schema upgrades applied one version at a time, each in a transaction, so an interrupted
upgrade leaves the previous version intact. A reply being generated is stored with status "streaming"
and saved as it grows; one still "streaming" when the store is next opened is marked "interrupted".

Damage: opening runs SQLite's quick integrity check. `HistoryStore.open` keeps a damaged file as a backup
beside it (`history.sqlite3.corrupt-<time>`, never overwritten), starts a fresh database and copies into it
what can still be read (`tui/history_repair.py`); `store.recovery` then says so. Every later SQLite failure
(a full disk, a read-only file, damage found mid-session) is a `HistoryError`: one line, no traceback.
Use from one thread only (the UI thread).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from offspec.errors import OffspecError

from .history_base import DONE, INTERRUPTED, STREAMING, HistoryDamaged, HistoryError
from .history_repair import recover

DB_FILENAME = "history.sqlite3"

# Each version's statements upgrade the schema from the previous version. Never edit a released
# version: add a new one.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE chats (
               id INTEGER PRIMARY KEY,
               title TEXT NOT NULL,
               system_prompt TEXT NOT NULL DEFAULT '',
               created_at REAL NOT NULL,
               updated_at REAL NOT NULL)""",
        """CREATE TABLE messages (
               id INTEGER PRIMARY KEY,
               chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
               role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
               content TEXT NOT NULL,
               status TEXT NOT NULL DEFAULT 'done',
               created_at REAL NOT NULL)""",
        "CREATE INDEX messages_by_chat ON messages(chat_id, id)",
    ),
    2: (
        "ALTER TABLE messages ADD COLUMN stats TEXT NOT NULL DEFAULT '{}'",
        "CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    # a reply's reasoning (offspec.util.reasoning), apart from its answer in `content`
    3: ("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''",),
}
SCHEMA_VERSION = max(MIGRATIONS)

@dataclass(frozen=True)
class Chat:
    id: int
    title: str
    system_prompt: str
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class StoredMessage:
    id: int
    chat_id: int
    role: str
    content: str
    status: str = DONE
    stats: dict = field(default_factory=dict)
    created_at: float = 0.0
    reasoning: str = ""  # a reply's reasoning (what the model wrote before its answer, `content`)


def _chat(row: sqlite3.Row) -> Chat:
    return Chat(row["id"], row["title"], row["system_prompt"], row["created_at"], row["updated_at"])


def _message(row: sqlite3.Row) -> StoredMessage:
    try:
        stats = json.loads(row["stats"] or "{}")
    except ValueError:
        stats = {}
    return StoredMessage(row["id"], row["chat_id"], row["role"], row["content"], row["status"], stats,
                         row["created_at"], row["reasoning"] or "")


_CORRUPT_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB (primary result codes)
_FULL, _READONLY, _CANTOPEN, _IOERR, _BUSY = 13, 8, 14, 10, 5


def _code(error: sqlite3.Error) -> Optional[int]:
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    return code & 0xFF if isinstance(code, int) else None


def is_damage(error: sqlite3.Error) -> bool:
    code = _code(error)
    if code is not None:
        return code in _CORRUPT_CODES
    text = str(error).lower()
    return "malformed" in text or "not a database" in text


def describe_error(path: Path, error: sqlite3.Error, doing: str) -> HistoryError:
    """A HistoryError that says what went wrong with the history at `path` and what to do."""
    where = f"chat history {path}"
    code, text = _code(error), " ".join(str(error).split())
    if is_damage(error):
        return HistoryDamaged(f"{where} is damaged ({text}) while {doing}; restart `offspec chat`: it keeps the "
                              f"damaged file as a backup and starts a fresh history")
    if code == _FULL or "disk is full" in text or "database or disk is full" in text:
        return HistoryError(f"cannot save the chat history ({doing}): the disk holding {path.parent} is full; "
                            f"free some space")
    if code in (_READONLY, _CANTOPEN) or "readonly" in text or "unable to open" in text:
        problem = read_only_problem(path)
        if problem:
            return HistoryError(f"{problem} ({doing})")
    if code == _BUSY or "locked" in text:
        return HistoryError(f"{where} is locked by another program ({doing}); close the other offspec chat "
                            f"or wait a moment")
    return HistoryError(f"{where}: {text} ({doing}); check the disk, or set OFFSPEC_DATA_DIR (or --data-dir) "
                        f"to another directory")


def read_only_problem(path: Path) -> Optional[str]:
    """Why the history at `path` cannot be written: its directory or the file is read-only (None if neither)."""
    directory = path.parent
    advice = "make it writable, or set OFFSPEC_DATA_DIR (or --data-dir) to a writable directory"
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
        what = "holds the chat history" if path.exists() else "is where the chat history goes"
        return (f"the directory {directory} {what} but is read-only (SQLite writes its journal beside the "
                f"database); {advice}")
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if file.exists() and not os.access(file, os.W_OK):
            return f"the chat history file {file} is read-only; {advice}"
    return None


def _ensure_directory(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HistoryError(f"cannot create the chat history directory {directory}: {e.strerror or e}; set "
                           f"OFFSPEC_DATA_DIR (or --data-dir) to a writable directory") from None
    if not directory.is_dir():
        raise HistoryError(f"{directory} is not a directory; set OFFSPEC_DATA_DIR (or --data-dir) to a directory")


class HistoryStore:
    """The chat database at `path` (created and upgraded on open). `HistoryStore(path)` refuses a damaged
    file with `HistoryDamaged`; `HistoryStore.open(data_dir)` sets it aside and recovers (see the module doc)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.recovery = None  # a tui.history_repair.Recovery when `open` replaced a damaged file
        _ensure_directory(self.path.parent)
        problem = read_only_problem(self.path)
        if problem:
            raise HistoryError(problem)
        try:
            self._db = sqlite3.connect(str(self.path), isolation_level=None)  # transactions are explicit
        except sqlite3.Error as e:
            raise describe_error(self.path, e, "opening it") from None
        self._db.row_factory = sqlite3.Row
        # text that damage made invalid UTF-8 (SQLite cannot see it) reads with U+FFFD marks, not an exception
        self._db.text_factory = lambda raw: raw.decode("utf-8", "replace")
        try:
            self._db.execute("PRAGMA busy_timeout = 5000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute("PRAGMA foreign_keys = ON")
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise HistoryDamaged(f"chat history {self.path} is damaged (integrity check: {problems[0]})")
            self._upgrade()
            with self._tx() as db:
                db.execute("UPDATE messages SET status = ? WHERE status = ?", (INTERRUPTED, STREAMING))
        except OffspecError:
            self._db.close()
            raise
        except sqlite3.Error as e:
            self._db.close()
            raise describe_error(self.path, e, "opening it") from None

    @classmethod
    def open(cls, data_dir: Path) -> "HistoryStore":
        """The history in `data_dir`. A damaged file is kept as a backup beside it and replaced by a fresh
        database holding what could be salvaged; `store.recovery` describes it (None when nothing happened)."""
        path = Path(data_dir) / DB_FILENAME
        try:
            return cls(path)
        except HistoryDamaged as damage:
            return recover(cls, path, str(damage))

    def close(self) -> None:
        self._db.close()

    def _fail(self, error: sqlite3.Error, doing: str) -> HistoryError:
        return describe_error(self.path, error, doing)

    @contextmanager
    def _tx(self, doing: str = "saving") -> Iterator[sqlite3.Connection]:
        """One write transaction: committed as a whole, or rolled back on any error. SQLite failures become
        a HistoryError."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise self._fail(e, doing) from None
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException as e:
            if self._db.in_transaction:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the first error is the one to report
            if isinstance(e, sqlite3.Error):
                raise self._fail(e, doing) from None
            raise

    def _read(self, sql: str, params: tuple = (), doing: str = "reading it") -> list[sqlite3.Row]:
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.Error as e:
            raise self._fail(e, doing) from None

    # -- schema -----------------------------------------------------------------------------

    def schema_version(self) -> int:
        has_table = self._read("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'")
        if not has_table:
            return 0
        rows = self._read("SELECT version FROM schema_version")
        return int(rows[0]["version"]) if rows else 0

    def _upgrade(self) -> None:
        with self._tx("preparing it") as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            if db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 0:
                db.execute("INSERT INTO schema_version (version) VALUES (0)")
        current = self.schema_version()
        if current > SCHEMA_VERSION:
            raise OffspecError(f"chat history {self.path} was written by a newer offspec (schema {current}, this one "
                               f"knows {SCHEMA_VERSION}); upgrade offspec or set OFFSPEC_DATA_DIR to another directory")
        for version in range(current + 1, SCHEMA_VERSION + 1):
            with self._tx(f"upgrading it to schema {version}") as db:
                for statement in MIGRATIONS[version]:
                    db.execute(statement)
                db.execute("UPDATE schema_version SET version = ?", (version,))

    # -- chats ------------------------------------------------------------------------------

    def create_chat(self, title: str, system_prompt: str = "") -> Chat:
        now = time.time()
        with self._tx("creating a chat") as db:
            cur = db.execute("INSERT INTO chats (title, system_prompt, created_at, updated_at) VALUES (?, ?, ?, ?)",
                             (title, system_prompt, now, now))
        return Chat(int(cur.lastrowid), title, system_prompt, now, now)

    def list_chats(self) -> list[Chat]:
        """All chats, the most recently used first."""
        return [_chat(r) for r in self._read("SELECT * FROM chats ORDER BY updated_at DESC, id DESC",
                                             doing="listing the chats")]

    def get_chat(self, chat_id: int) -> Optional[Chat]:
        rows = self._read("SELECT * FROM chats WHERE id = ?", (chat_id,), "opening a chat")
        return _chat(rows[0]) if rows else None

    def update_chat(self, chat_id: int, *, title: Optional[str] = None, system_prompt: Optional[str] = None) -> None:
        with self._tx("updating a chat") as db:
            if title is not None:
                db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))
            if system_prompt is not None:
                db.execute("UPDATE chats SET system_prompt = ? WHERE id = ?", (system_prompt, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        with self._tx("deleting a chat") as db:
            db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    # -- messages ---------------------------------------------------------------------------

    def add_message(self, chat_id: int, role: str, content: str, *, status: str = DONE,
                    stats: Optional[dict] = None) -> StoredMessage:
        with self._tx("saving a message") as db:
            return self._insert_message(db, chat_id, role, content, status, stats)

    @staticmethod
    def _insert_message(db: sqlite3.Connection, chat_id: int, role: str, content: str, status: str,
                        stats: Optional[dict]) -> StoredMessage:
        now = time.time()
        stats = dict(stats or {})
        cur = db.execute(
            "INSERT INTO messages (chat_id, role, content, status, stats, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (chat_id, role, content, status, json.dumps(stats), now))
        db.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (now, chat_id))
        return StoredMessage(int(cur.lastrowid), chat_id, role, content, status, stats, now)

    def start_turn(self, chat: Optional[Chat], new_title: str, system_prompt: str,
                   text: str) -> tuple[Chat, StoredMessage, StoredMessage]:
        """One transaction: the chat (created when `chat` is None), the user message and an empty reply in
        status "streaming". All or nothing, so a failed save leaves no half turn behind."""
        with self._tx("saving your message") as db:
            if chat is None:
                now = time.time()
                cur = db.execute("INSERT INTO chats (title, system_prompt, created_at, updated_at) "
                                 "VALUES (?, ?, ?, ?)", (new_title, system_prompt, now, now))
                chat = Chat(int(cur.lastrowid), new_title, system_prompt, now, now)
            user = self._insert_message(db, chat.id, "user", text, DONE, None)
            reply = self._insert_message(db, chat.id, "assistant", "", STREAMING, None)
        return chat, user, reply

    def update_message(self, message_id: int, content: str, *, status: Optional[str] = None,
                       stats: Optional[dict] = None, reasoning: Optional[str] = None) -> None:
        with self._tx("saving a reply") as db:
            db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))
            if reasoning is not None:
                db.execute("UPDATE messages SET reasoning = ? WHERE id = ?", (reasoning, message_id))
            if status is not None:
                db.execute("UPDATE messages SET status = ? WHERE id = ?", (status, message_id))
            if stats is not None:
                db.execute("UPDATE messages SET stats = ? WHERE id = ?", (json.dumps(stats), message_id))

    def delete_message(self, message_id: int) -> None:
        with self._tx("deleting a message") as db:
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, chat_id: int) -> list[StoredMessage]:
        rows = self._read("SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,), "reading a chat")
        return [_message(r) for r in rows]

    def get_message(self, message_id: int) -> Optional[StoredMessage]:
        rows = self._read("SELECT * FROM messages WHERE id = ?", (message_id,), "reading a message")
        return _message(rows[0]) if rows else None

    # -- settings ---------------------------------------------------------------------------

    def get_setting(self, key: str) -> Optional[str]:
        rows = self._read("SELECT value FROM settings WHERE key = ?", (key,), "reading the settings")
        return rows[0]["value"] if rows else None

    def set_setting(self, key: str, value: str) -> None:
        with self._tx("saving the settings") as db:
            db.execute("INSERT INTO settings (key, value) VALUES (?, ?) "
                       "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))
