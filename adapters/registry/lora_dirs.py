"""`--lora-dir DIR`: every folder below DIR holding a PEFT adapter is servable under its relative path.

    dirs = LoraDirectories(["/srv/adapters"])
    found = dirs.resolve("acme/support-v2")   # AdapterLocation or None (unknown, or not safe)
    names = dirs.scan()                        # bounded walk, cached for a few seconds

Names: a relative path of plain components (no `..`, `.`, empty parts, backslashes, commas, NUL, no leading `/`).

Folders are tenants' areas. A name `P/REST` (its first component `P`) is served only from inside `DIR/P`:
- `DIR/P` itself must be a real directory (a symlink there is refused: it would hand P's names to another
  folder), and every symlink met below it (folder or file, relative or absolute target, chains included) is
  checked lexically before it is followed: its target must stay inside `DIR/P`. The real paths of the folder
  and of its files (every link resolved) must lie inside `DIR/P`.
- An unprefixed name `NAME` (no `/`) is served only if its folder's real path is a first-level folder of DIR
  (`DIR/NAME` itself, or a link to a sibling such as `latest -> v3`) and its files lie directly in that
  folder: never from inside a folder whose entries are served as `X/...` (a tenant's folder).
Anything else resolves to None (the gateway answers `model_not_found`, as for an absent name). Resolution
only looks (lstat, readlink); the files are opened later by `adapters/registry/folder_files.py`, which walks the
resolved real paths again without following any link, so a link swapped after resolution is caught too.
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
ADDED_TOKENS_FILE = "added_tokens.json"   # optional; when present it is read (and refused if it adds tokens)
MAX_NAME_CHARS = 512
MAX_SYMLINK_HOPS = 16

Fingerprint = tuple[int, ...]   # (size, mtime_ns, inode) of the config and of the weights
MISSING = ""                     # `locate_file`: the file does not exist (a refused one is None)


@dataclass(frozen=True)
class AdapterLocation:
    name: str            # the served name: the folder's path relative to its DIR, with "/" separators
    root: str            # DIR's real path
    path: str            # the folder's real path (inside `area`)
    fingerprint: Fingerprint
    area: str            # the real folder the entry's folder and files must lie in: DIR/P, or DIR (unprefixed)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def valid_name(name: str) -> bool:
    # a comma: /metrics lists the running adapters comma-separated (running_lora_adapters, as the Gateway API
    # Inference Extension's endpoint picker reads it), so "a,b" would read as two adapters
    if not name or len(name) > MAX_NAME_CHARS or any(c in name for c in "\x00\\,") or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _walk(start: str, parts: list[str], area: str) -> str | None:
    """The real path of start/parts (`start` a real path inside `area`), following symlinks only while each
    hop's target stays inside `area`; None if a hop leaves it, a part is missing, or there are too many hops."""
    cur, todo, hops = start, list(parts), 0
    while todo:
        part = todo.pop(0)
        nxt = os.path.join(cur, part)
        try:
            st = os.lstat(nxt)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            try:   # `cur` holds no link (each was replaced by its target), so ".." here is the real parent
                target = os.path.normpath(os.path.join(cur, os.readlink(nxt)))
            except OSError:
                return None
            if hops > MAX_SYMLINK_HOPS or not _inside(target, area):
                return None
            rel = os.path.relpath(target, area)
            cur, todo = area, ([] if rel == "." else rel.split(os.sep)) + todo
        else:
            cur = nxt
    real = os.path.realpath(cur)   # a second look: a link changed during the walk is caught here
    return real if _inside(real, area) else None


def folder_allowed(real: str, root: str, area: str) -> bool:
    """May an entry of `area` (DIR/P, or DIR for unprefixed names) live in the real folder `real`?"""
    if area == root:
        return os.path.dirname(real) == root
    return _inside(real, area)


def file_allowed(real: str, loc: AdapterLocation) -> bool:
    """May a file of the entry `loc` be the real file `real`? Anywhere inside DIR/P for a name `P/...`; an
    unprefixed entry's files lie directly in its own first-level folder."""
    if loc.area == loc.root:
        return os.path.dirname(real) == loc.path
    return _inside(real, loc.area) and real != loc.area


def locate_file(loc: AdapterLocation, fname: str) -> str | None:
    """The real path of one of `loc`'s files if it may be read, `MISSING` if there is no such file, None if
    it exists but is not allowed (a link leaving the entry's area, a file that is not a regular file)."""
    if not os.path.lexists(os.path.join(loc.path, fname)):
        return MISSING
    real = _walk(loc.path, [fname], loc.area)
    if real is None or not file_allowed(real, loc) or not os.path.isfile(real):
        return None
    return real


def area_of(root: str, parts: list[str]) -> str | None:
    """The real folder a name's entry must lie in: DIR for an unprefixed name, else DIR/P, which must be a
    real directory (not a symlink). None: the name cannot be served."""
    if len(parts) == 1:
        return root
    first = os.path.join(root, parts[0])
    try:
        st = os.lstat(first)
    except OSError:
        return None
    return first if stat.S_ISDIR(st.st_mode) else None


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
        parts = name.split("/")
        area = area_of(self.root, parts)
        if area is None:
            return None
        start, rest = (self.root, parts) if area == self.root else (area, parts[1:])
        path = _walk(start, rest, area)
        if path is None or not folder_allowed(path, self.root, area) or not os.path.isdir(path):
            return None
        loc = AdapterLocation(name, self.root, path, (), area)
        for fname in (CONFIG_FILE, WEIGHTS_FILE, ADDED_TOKENS_FILE):
            real = locate_file(loc, fname)
            if real is None or (real == MISSING and fname != ADDED_TOKENS_FILE):
                return None
        fp = fingerprint(path)
        return None if fp is None else AdapterLocation(name, self.root, path, fp, area)

    @staticmethod
    def _plain_files(folder: str) -> bool:
        """Both files are regular files (no links) and added_tokens.json, if any, is one too."""
        try:
            if not all(stat.S_ISREG(os.lstat(os.path.join(folder, f)).st_mode) for f in (CONFIG_FILE, WEIGHTS_FILE)):
                return False
        except OSError:
            return False
        try:
            return stat.S_ISREG(os.lstat(os.path.join(folder, ADDED_TOKENS_FILE)).st_mode)
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def scan(self) -> list[str]:
        """Names of adapter folders (no symlinks followed; at most `max_scan_dirs` folders visited). A folder the
        walk reaches is a real directory, so it lies in its name's area; its files are checked by `resolve`
        unless they are plain files."""
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
        """Checks a known entry again (before each read): still safe, still inside its area."""
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
