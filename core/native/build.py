"""C kernels for the CPU path, built at first use with the system C compiler and cached.

A kernel's source sits beside the Python module that calls it (e.g. core/attention/cpu_paged_decode.c); shared
helpers are headers in this folder (bf16.h), on the include path. `load`
compiles it once into a shared library under ~/.cache/loraplex/native/ (where the home is not writable: in a temp
folder, removed as soon as the library is opened, whose mapping the process keeps), named by a hash of the source,
the flags, the compiler's version and this CPU's instruction-set flags (`-march=native`), and opens it with ctypes.
The library links the process's OpenMP runtime: torch's own, already loaded (the same soname), so the kernels share
torch's threads instead of starting a second pool.

No compiler, a failed build or LORAPLEX_NATIVE_KERNELS=0: `load` returns None (the reason is logged once) and
the caller keeps its torch path. A build takes about 0.5 s; nothing is built on a GPU engine.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping, TypeVar

from core.environment import variables as env

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120.0
HEADERS = Path(__file__).parent   # the kernels' shared headers (bf16.h), on the include path
_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}
K = TypeVar("K")


def compiler() -> str | None:
    """The C compiler `load` runs: cc, else gcc, else clang, on PATH; None without one."""
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path | None:
    """~/.cache/loraplex/native, or None where the home is not writable."""
    home = Path.home() / ".cache" / "loraplex" / "native"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return None


def _open(source: Path, cc: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library built from `source` (or found in the cache), opened. Without a writable cache it is built in a
    temp folder removed once the library is open (a loaded library's mapping outlives its file)."""
    out_dir = _cache_dir()
    if out_dir is not None:
        return ctypes.CDLL(str(_build(source, cc, flags, out_dir)))
    with tempfile.TemporaryDirectory(prefix="loraplex_native_") as tmp:
        return ctypes.CDLL(str(_build(source, cc, flags, Path(tmp))))


def _build(source: Path, cc: str, flags: tuple[str, ...], out_dir: Path) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = [h.read_text() for h in sorted(HEADERS.glob("*.h"))]   # what a source may #include
    key = hashlib.sha256("\0".join((source.read_text(), *headers, " ".join(flags), version, _cpu_flags())).encode())
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, f"-I{HEADERS}", "-o", tmp, str(source)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)   # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The shared library built from `source` (a .c file) with FLAGS and `extra_flags` (e.g. -ffp-contract=off
    where results must round like torch's separate ops), or None where native kernels are off or cannot be built.
    Built once per process (and cached across processes); thread-safe."""
    with _lock:
        if source in _loaded:
            return _loaded[source]
        lib = None
        if env.NATIVE_KERNELS.get() == "0":
            reason = "LORAPLEX_NATIVE_KERNELS=0"
        elif (cc := compiler()) is None:
            reason = "no C compiler (cc, gcc or clang) on PATH"
        else:
            try:   # callers import torch first: its OpenMP runtime is loaded, and the library binds to it
                lib = _open(source, cc, FLAGS + tuple(extra_flags))
                reason = ""
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                reason = f"build failed: {exc}"
        if lib is None:
            log.warning("CPU kernel %s: %s; the torch path runs instead", source.stem, reason)
        _loaded[source] = lib
        return lib


def load_functions(source: Path, names: Mapping[K, str], argtypes: list[Any], restype: Any,
                   extra_flags: tuple[str, ...] = ()) -> dict[K, Any]:
    """The functions `names` (e.g. one per dtype) of the library `load` builds from `source`, their ctypes
    signatures set; empty where the library cannot be built (the caller's torch path runs)."""
    lib = load(source, extra_flags)
    functions: dict[K, Any] = {}
    if lib is not None:
        for key, name in names.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            functions[key] = fn
    return functions
