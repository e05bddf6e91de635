"""Chat history in SQLite: chats, their messages and the chat settings.

Crash safety: WAL journal with synchronous=FULL, every write in its own transaction (one commit per
message), and schema upgrades applied one version at a time, each in a transaction, so an interrupted
upgrade leaves the previous version intact. A reply being generated is stored with status "streaming"
and saved as it grows; one still "streaming" when the store is next opened is marked "interrupted".
Use from one thread only (the UI thread).
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from offspec.errors import OffspecError

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
}
SCHEMA_VERSION = max(MIGRATIONS)

# Message status values.
DONE, STREAMING, CANCELLED, INTERRUPTED, ERROR = "done", "streaming", "cancelled", "interrupted", "error"


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


def _chat(row: sqlite3.Row) -> Chat:
    return Chat(row["id"], row["title"], row["system_prompt"], row["created_at"], row["updated_at"])


def _message(row: sqlite3.Row) -> StoredMessage:
    try:
        stats = json.loads(row["stats"] or "{}")
    except ValueError:
        stats = {}
    return StoredMessage(row["id"], row["chat_id"], row["role"], row["content"], row["status"], stats,
                         row["created_at"])


class HistoryStore:
    """The chat database at `path` (created and upgraded on open)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), isolation_level=None)  # transactions are explicit
        except (OSError, sqlite3.Error) as e:
            raise OffspecError(f"cannot open chat history {self.path}: {e}; set OFFSPEC_DATA_DIR to a writable directory") from None
        self._db.row_factory = sqlite3.Row
        try:
            self._db.execute("PRAGMA busy_timeout = 5000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._upgrade()
            with self._tx() as db:
                db.execute("UPDATE messages SET status = ? WHERE status = ?", (INTERRUPTED, STREAMING))
        except OffspecError:
            self._db.close()
            raise
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise OffspecError(f"chat history {self.path} is unreadable ({e}); move the file away or set "
                               "OFFSPEC_DATA_DIR to another directory") from None

    @classmethod
    def open(cls, data_dir: Path) -> "HistoryStore":
        return cls(Path(data_dir) / DB_FILENAME)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed as a whole, or rolled back on any error."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- schema -----------------------------------------------------------------------------

    def schema_version(self) -> int:
        has_table = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'").fetchone()
        if not has_table:
            return 0
        row = self._db.execute("SELECT version FROM schema_version").fetchone()
        return int(row["version"]) if row else 0

    def _upgrade(self) -> None:
        with self._tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            if db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 0:
                db.execute("INSERT INTO schema_version (version) VALUES (0)")
        current = self.schema_version()
        if current > SCHEMA_VERSION:
            raise OffspecError(f"chat history {self.path} was written by a newer offspec (schema {current}, this one "
                               f"knows {SCHEMA_VERSION}); upgrade offspec or set OFFSPEC_DATA_DIR to another directory")
        for version in range(current + 1, SCHEMA_VERSION + 1):
            with self._tx() as db:
                for statement in MIGRATIONS[version]:
                    db.execute(statement)
                db.execute("UPDATE schema_version SET version = ?", (version,))

    # -- chats ------------------------------------------------------------------------------

    def create_chat(self, title: str, system_prompt: str = "") -> Chat:
        now = time.time()
        with self._tx() as db:
            cur = db.execute("INSERT INTO chats (title, system_prompt, created_at, updated_at) VALUES (?, ?, ?, ?)",
                             (title, system_prompt, now, now))
        return Chat(int(cur.lastrowid), title, system_prompt, now, now)

    def list_chats(self) -> list[Chat]:
        """All chats, the most recently used first."""
        rows = self._db.execute("SELECT * FROM chats ORDER BY updated_at DESC, id DESC").fetchall()
        return [_chat(r) for r in rows]

    def get_chat(self, chat_id: int) -> Optional[Chat]:
        row = self._db.execute("SELECT * FROM chats WHERE id = ?", (chat_id,)).fetchone()
        return _chat(row) if row else None

    def update_chat(self, chat_id: int, *, title: Optional[str] = None, system_prompt: Optional[str] = None) -> None:
        with self._tx() as db:
            if title is not None:
                db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))
            if system_prompt is not None:
                db.execute("UPDATE chats SET system_prompt = ? WHERE id = ?", (system_prompt, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    # -- messages ---------------------------------------------------------------------------

    def add_message(self, chat_id: int, role: str, content: str, *, status: str = DONE,
                    stats: Optional[dict] = None) -> StoredMessage:
        now = time.time()
        stats = dict(stats or {})
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (chat_id, role, content, status, stats, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, status, json.dumps(stats), now))
            db.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (now, chat_id))
        return StoredMessage(int(cur.lastrowid), chat_id, role, content, status, stats, now)

    def update_message(self, message_id: int, content: str, *, status: Optional[str] = None,
                       stats: Optional[dict] = None) -> None:
        with self._tx() as db:
            db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))
            if status is not None:
                db.execute("UPDATE messages SET status = ? WHERE id = ?", (status, message_id))
            if stats is not None:
                db.execute("UPDATE messages SET stats = ? WHERE id = ?", (json.dumps(stats), message_id))

    def delete_message(self, message_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, chat_id: int) -> list[StoredMessage]:
        rows = self._db.execute("SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)).fetchall()
        return [_message(r) for r in rows]

    def get_message(self, message_id: int) -> Optional[StoredMessage]:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        return _message(row) if row else None

    # -- settings ---------------------------------------------------------------------------

    def get_setting(self, key: str) -> Optional[str]:
        row = self._db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return row["value"] if row else None

    def set_setting(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO settings (key, value) VALUES (?, ?) "
                       "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))
