"""A store's location: a local path (relative is fine) or a pyarrow filesystem URI (s3://, gs://, file://, …), and
how the local folders we create are made owner-only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

# Records, journals and run directories hold prompts and token ids: nobody but their owner reads them.
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | Path) -> Path:
    """`path` as a folder, each part this creates owner-only (0700; one that exists keeps its mode)."""
    target = missing_part = Path(path)
    missing = []
    while not missing_part.is_dir() and missing_part != missing_part.parent:
        missing.append(missing_part)
        missing_part = missing_part.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)  # the umask can only take bits away from 0700
        except FileExistsError:
            if not folder.is_dir():
                raise
    return target


class StorageError(ValueError):
    """A store that cannot be used as asked: not there, not listable, not a folder, an unreadable file."""


class InputNotFound(FileNotFoundError):
    """Nothing where the user pointed (no shards, no metrics, no model): a mistake of theirs, said in one line."""


def one_line(exc: BaseException) -> str:
    """An exception as one short line (pyarrow's messages run over several)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def resolve_path(uri: str | Path) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and path for a local path (relative is fine) or a URI (s3://, gs://, file://, …)."""
    uri = str(uri)
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


@dataclass
class Location:
    """A path or URI resolved to its filesystem, and what is there now (a file, a folder, nothing)."""

    uri: str
    filesystem: pafs.FileSystem
    path: str
    type: pafs.FileType

    @classmethod
    def of(cls, uri: str | Path) -> Location:
        filesystem, path = resolve_path(uri)
        return cls(str(uri), filesystem, path, filesystem.get_file_info(path).type)

    @property
    def exists(self) -> bool:
        return self.type != pafs.FileType.NotFound

    @property
    def is_local_folder(self) -> bool:
        return self.type == pafs.FileType.Directory and isinstance(self.filesystem, pafs.LocalFileSystem)

    def parquet_files(self) -> list[str]:
        """The file itself, or every `*.parquet` under the folder, sorted.

        Names starting with `_` or `.` at any depth below the folder are skipped, as pyarrow datasets skip them:
        the live journal, the quarantine, temp files of a write in progress, `_summary.json`.
        """
        if self.type != pafs.FileType.Directory:
            return [self.path]
        try:
            found = self.filesystem.get_file_info(pafs.FileSelector(self.path, recursive=True))
        except OSError as exc:
            raise StorageError(f"{self.uri}: cannot list the folder ({one_line(exc)})") from exc
        return sorted(
            f.path
            for f in found
            if f.type == pafs.FileType.File
            and f.path.endswith(".parquet")
            and not any(part[:1] in "_." for part in Path(f.path[len(self.path) :]).parts)
        )
