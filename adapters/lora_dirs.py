"""`--lora-dir DIR`: every folder below DIR holding a PEFT adapter is servable under its relative path.

    dirs = LoraDirectories(["/srv/adapters"])
    found = dirs.resolve("acme/support-v2")   # AdapterLocation or None (unknown, or not safe)
    names = dirs.scan()                        # bounded walk, cached for a few seconds

Safety: a name is a relative path of plain components (no `..`, `.`, empty parts, backslashes, NUL, no
leading `/`). Every symlink met on the way is checked lexically before it is followed, and the final real
path of the folder and of both files must lie inside DIR's real path; anything else resolves to None (the
gateway answers `model_not_found`), and no file outside DIR is ever opened.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from adapters.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_CHARS = 512
MAX_SYMLINK_HOPS = 16

Fingerprint = tuple[int, ...]   # (size, mtime_ns, inode) of the config and of the weights


@dataclass(frozen=True)
class AdapterLocation:
    name: str            # the served name: the folder's path relative to its DIR, with "/" separators
    root: str            # DIR's real path
    path: str            # the folder's real path (inside root)
    fingerprint: Fingerprint


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def valid_name(name: str) -> bool:
    if not name or len(name) > MAX_NAME_CHARS or "\x00" in name or "\\" in name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _walk_inside(root: str, parts: list[str]) -> str | None:
    """The real path of root/parts, following symlinks only while each hop stays inside root."""
    cur, todo, hops = root, list(parts), 0
    while todo:
        part = todo.pop(0)
        nxt = os.path.join(cur, part)
        try:
            st = os.lstat(nxt)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            target = os.path.normpath(os.path.join(cur, os.readlink(nxt)))
            if hops > MAX_SYMLINK_HOPS or not _inside(target, root):
                return None
            rel = os.path.relpath(target, root)
            cur, todo = root, ([] if rel == "." else rel.split(os.sep)) + todo
        else:
            cur = nxt
    real = os.path.realpath(cur)
    return real if _inside(real, root) else None


def fingerprint(path: str) -> Fingerprint | None:
    out: list[int] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            return None
        out += [st.st_size, st.st_mtime_ns, st.st_ino]
    return tuple(out)


class LoraDirectory:
    """One `--lora-dir`: safe lazy resolution and a bounded, cached listing."""

    def __init__(self, root: str, max_scan_dirs: int = 20000, max_depth: int = 8, scan_ttl_s: float = 5.0) -> None:
        self.root = os.path.realpath(os.path.expanduser(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"--lora-dir {root!r} is not a directory")
        self.max_scan_dirs, self.max_depth, self.scan_ttl_s = max_scan_dirs, max_depth, scan_ttl_s
        self._lock = threading.Lock()
        self._scan: tuple[float, list[str]] | None = None

    def resolve(self, name: str) -> AdapterLocation | None:
        if not valid_name(name):
            return None
        path = _walk_inside(self.root, name.split("/"))
        if path is None or not os.path.isdir(path):
            return None
        for fname in (CONFIG_FILE, WEIGHTS_FILE):
            real = _walk_inside(path, [fname])
            if real is None or not _inside(real, self.root) or not os.path.isfile(real):
                return None
        fp = fingerprint(path)
        return None if fp is None else AdapterLocation(name, self.root, path, fp)

    @staticmethod
    def _plain_files(folder: str) -> bool:
        try:
            return all(stat.S_ISREG(os.lstat(os.path.join(folder, f)).st_mode) for f in (CONFIG_FILE, WEIGHTS_FILE))
        except OSError:
            return False

    def scan(self) -> list[str]:
        """Names of adapter folders (no symlinks followed; at most `max_scan_dirs` folders visited)."""
        with self._lock:
            if self._scan is not None and time.monotonic() - self._scan[0] < self.scan_ttl_s:
                return self._scan[1]
        names: list[str] = []
        visited = 0
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            visited += 1
            rel = os.path.relpath(dirpath, self.root)
            depth = 0 if rel == "." else rel.count(os.sep) + 1
            if depth >= self.max_depth or visited >= self.max_scan_dirs:
                dirnames[:] = []
            dirnames.sort()
            if rel != "." and CONFIG_FILE in filenames and WEIGHTS_FILE in filenames:
                name = rel.replace(os.sep, "/")
                if valid_name(name) and (self._plain_files(dirpath) or self.resolve(name) is not None):
                    names.append(name)
            if visited >= self.max_scan_dirs:
                break
        names.sort()
        with self._lock:
            self._scan = (time.monotonic(), names)
        return names


class LoraDirectories:
    """All `--lora-dir`s: the first directory holding a name wins."""

    def __init__(self, roots: Sequence[str]) -> None:
        self.dirs = [LoraDirectory(r) for r in roots]

    def __bool__(self) -> bool:
        return bool(self.dirs)

    def resolve(self, name: str) -> AdapterLocation | None:
        for d in self.dirs:
            found = d.resolve(name)
            if found is not None:
                return found
        return None

    def relocate(self, loc: AdapterLocation) -> AdapterLocation | None:
        """Checks a known entry again (before each read): still safe, still inside its root."""
        for d in self.dirs:
            if d.root == loc.root:
                return d.resolve(loc.name)
        return None

    def scan(self) -> dict[str, str]:
        """Adapter name -> its folder (first directory wins), sorted by name within each directory."""
        seen: dict[str, str] = {}
        for d in self.dirs:
            for name in d.scan():
                seen.setdefault(name, os.path.join(d.root, *name.split("/")))
        return seen


class FailedReads:
    """Directory adapters whose first read failed, remembered until their files change: a request naming one
    gets that read's error when its name resolves (a 400 before any response byte) instead of a new read.
    Thread-safe. Kept by the engine's `AdapterRegistry` and by the API process's mirror of it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: dict[str, tuple[Fingerprint, AdapterError]] = {}

    def check(self, loc: AdapterLocation) -> None:
        """Raises the remembered error while the files are those that failed; forgets it once they changed."""
        with self._lock:
            failed = self._failed.get(loc.name)
            if failed is not None and failed[0] == loc.fingerprint:
                raise failed[1].fresh()
            self._failed.pop(loc.name, None)

    def remember(self, name: str, path: str, error: AdapterError) -> None:
        now = fingerprint(path)
        if now is not None:
            with self._lock:
                self._failed[name] = (now, error)

    def forget(self, name: str) -> None:
        with self._lock:
            self._failed.pop(name, None)
