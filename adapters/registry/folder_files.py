"""Reading a `--lora-dir` adapter's files so that no file outside its allowed folder is ever opened, even when
a link is swapped after the name was resolved (time of check / time of use).

    loc = dirs.relocate(entry.location)            # resolved again: real paths, every link checked
    with FolderFiles(loc) as files:
        fp = files.fingerprint()                    # opens config + weights now; fstat of the open files
        adapter = load_peft_adapter(files, dims, max_lora_rank)
        assert files.fingerprint() == fp            # unchanged while being read

How: each file's real path comes from `lora_dirs.locate_file` (every link checked to stay inside the entry's
area), then `open_beneath` opens DIR (a real path fixed at start-up) and walks down to the file one component
at a time with `openat(..., O_NOFOLLOW)`: a component that became a symlink since the check fails to open
(ELOOP / ENOTDIR), so the descriptor obtained is the file at that real path, inside the area, by construction
(no string comparison after the fact). The file must be a regular file (`fstat`; opened O_NONBLOCK so a FIFO
put in its place cannot block the loader). A file that cannot be opened this way is as absent as the name:
`model_not_found` (404). Hard links are not links: a hard link inside a tenant's folder is that tenant's file.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

from adapters.peft.adapter_files import AdapterFiles
from adapters.errors import AdapterError
from adapters.registry.lora_dirs import CONFIG_FILE, MISSING, WEIGHTS_FILE, AdapterLocation, Fingerprint, locate_file

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


def gone(name: str) -> AdapterError:
    """A `--lora-dir` entry whose files left its folder: to the caller, exactly an absent model."""
    return AdapterError(f"The model `{name}` does not exist.", code="model_not_found", status=404)


def open_beneath(root: str, real: str) -> int:
    """A read-only descriptor of the regular file at `real` (a real path strictly inside the real directory
    `root`), reached from `root` without following any symlink. Raises OSError otherwise."""
    rel = os.path.relpath(real, root)
    parts = rel.split(os.sep)
    if rel == "." or parts[0] == os.pardir or os.path.isabs(rel):
        raise OSError(errno.EXDEV, "not beneath the root")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            nxt = os.open(part, _DIR_FLAGS if i < len(parts) - 1 else _FILE_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


class FolderFiles(AdapterFiles):
    """A resolved `--lora-dir` entry's files, opened beneath its DIR without following links. Each file is
    opened once and kept open until `close()`; `open` hands out a duplicate positioned at the start."""

    def __init__(self, loc: AdapterLocation) -> None:
        self.loc, self.path, self.label = loc, loc.path, loc.name
        self._fds: dict[str, int] = {}

    def _fd(self, fname: str) -> int | None:
        if fname in self._fds:
            return self._fds[fname]
        real = locate_file(self.loc, fname)
        if real == MISSING:
            return None
        if real is None:
            raise gone(self.loc.name)
        try:
            fd = open_beneath(self.loc.root, real)
        except OSError:
            raise gone(self.loc.name) from None
        self._fds[fname] = fd
        return fd

    def open(self, fname: str) -> BinaryIO | None:
        fd = self._fd(fname)
        if fd is None:
            return None
        dup = os.dup(fd)
        os.lseek(dup, 0, os.SEEK_SET)   # a dup shares the offset: every reader starts at the beginning
        return os.fdopen(dup, "rb")

    def fingerprint(self) -> Fingerprint:
        """(size, mtime_ns, inode) of the config and the weights as opened (opening them now if needed)."""
        out: list[int] = []
        for fname in (CONFIG_FILE, WEIGHTS_FILE):
            fd = self._fd(fname)
            if fd is None:
                raise gone(self.loc.name)
            st = os.fstat(fd)
            out += [st.st_size, st.st_mtime_ns, st.st_ino]
        return tuple(out)

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> "FolderFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
