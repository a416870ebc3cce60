"""The on-demand registry without a model: randomized operations with check_integrity() after each (host
bound, refcounts, generations), shared first loads, the negative cache, and `--lora-dir` path safety."""
from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.peft.adapter_files import AdapterFiles
from adapters.layers.dims import BaseModelDims
from adapters.errors import AdapterError
from adapters.registry.lora_dirs import LoraDirectory
from adapters.registry.registry import AdapterRegistry

DIMS = BaseModelDims(hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2, head_dim=4, num_layers=2,
                     vocab_size=32)


def _touch_adapter(folder: Path, tag: str = "x") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 2, "tag": "%s"}' % tag)
    (folder / "adapter_model.safetensors").write_text(tag)


class FakeLoader:
    """Adapters from a path, slowly (so loads overlap); folders named bad* fail; counts reads per path."""

    def __init__(self, delay_s: float = 0.002) -> None:
        self.delay_s, self.reads, self.lock = delay_s, {}, threading.Lock()

    def __call__(self, source: str | AdapterFiles, dims: BaseModelDims, rank: int) -> LoRAAdapter:
        path = source.path if isinstance(source, AdapterFiles) else source   # a --lora-dir entry: its opened files
        with self.lock:
            self.reads[path] = self.reads.get(path, 0) + 1
        time.sleep(self.delay_s)
        if os.path.basename(path).startswith("bad"):
            raise AdapterError("bad adapter", code="corrupt_adapter_weights")
        mod = LoRAModule(torch.ones(2, 16), torch.ones(16, 2), 1.0)
        return LoRAAdapter(source=path, path=path, modules={(0, "q_proj"): mod})


def _registry(root: Path, max_cpu: int, loader: FakeLoader) -> AdapterRegistry:
    return AdapterRegistry(DIMS, 8, max_cpu, loader=loader, lora_dirs=[str(root)])


def test_randomized_operations_keep_invariants(tmp_path: Path) -> None:
    rng = random.Random(0)
    root = tmp_path / "loras"
    names = [f"t{i % 4}/a{i}" for i in range(24)] + ["t0/bad0", "t1/bad1"]
    for n in names:
        _touch_adapter(root / n)
    loader = FakeLoader()
    reg = _registry(root, 5, loader)
    held: list = []                                  # entries acquired by "requests"
    resolved: list = []                              # names resolved by the gateway, not admitted yet
    for step in range(1500):
        ready_held = [e for e in held if e.ready]   # host copies that requests hold: must survive this op
        op = rng.random()
        if op < 0.15:
            try:
                entry = reg.lookup(rng.choice(names))
            except AdapterError:
                entry = None
            if entry is not None:
                resolved.append(entry)
        elif op < 0.3 and resolved:                  # admission, some operations after the resolution
            entry = resolved.pop(rng.randrange(len(resolved)))
            current = entry
            while current.unloaded and current.replaced_by is not None:
                current = current.replaced_by
            if current.unloaded:                     # unloaded since the lookup: a 404, nothing is held
                with pytest.raises(AdapterError):
                    reg.acquire(entry)
            else:                                    # replaced since (an admin load): the replacement is held
                got = reg.acquire(entry)
                assert got is current and reg.get(entry.name) is got
                held.append(got)
        elif op < 0.5 and held:
            reg.release(held.pop(rng.randrange(len(held))))
        elif op < 0.75:
            for entry in list(held):                 # the engine's pump, in queue order
                if not entry.ready and not entry.loading and entry.error is None and reg.can_start_load():
                    reg.start_load(entry)
        elif op < 0.8:
            name = rng.choice(names)
            if reg.get(name) is not None:
                reg.unload(name)
        elif op < 0.85:
            name = rng.choice(names[:24])
            try:                                     # an admin load wins over the directory entry; with
                reg.load(name, str(root / name), replace=rng.random() < 0.5)   # replace, over a loaded one too
            except AdapterError as e:
                assert e.code == "duplicate_adapter"
        elif op < 0.9:
            reg.take_released()
        else:
            reg.wait_for_loads(0.005)
        reg.check_integrity()
        assert reg.num_host <= 5
        assert all(e.ready for e in ready_held), "a held host copy was dropped"
    while reg.num_loading:
        reg.wait_for_loads(0.05)
    reg.check_integrity()
    assert reg.stats.num_by_outcome["success"] > 20 and reg.stats.num_by_outcome["error"] >= 1
    for _ in range(1000):                            # every held entry, unloaded or not, is served in the end
        for entry in [e for e in held if e.ready or e.error is not None]:
            held.remove(entry)                       # its request ran (or failed) and finished
            reg.release(entry)
        if not held:
            break
        for entry in held:
            if not entry.loading and reg.can_start_load():
                reg.start_load(entry)
        reg.wait_for_loads(0.05)
        reg.check_integrity()
    assert not held, f"{len(held)} held adapter(s) never loaded"
    reg.take_released()
    reg.check_integrity()


def test_unload_during_read_keeps_copy_for_holders(tmp_path: Path) -> None:
    """An unload while a held entry's weights are being read: the read is kept (its requests finish), and the
    copy goes once the last holder releases it. An unheld entry's read is discarded."""
    root = tmp_path / "loras"
    _touch_adapter(root / "acme" / "one")
    _touch_adapter(root / "acme" / "two")
    reg = _registry(root, 4, FakeLoader(delay_s=0.1))
    held, unheld = reg.lookup("acme/one"), reg.lookup("acme/two")
    reg.acquire(held)
    reg.start_load(held)
    reg.start_load(unheld)
    reg.unload("acme/one")
    reg.unload("acme/two")
    while reg.num_loading:
        reg.wait_for_loads(0.1)
    assert held.ready and not unheld.ready
    assert reg.stats.num_by_outcome["discarded"] == 1
    with pytest.raises(AdapterError) as excinfo:   # a request resolved before the unload, admitted after it
        reg.acquire(held)
    assert excinfo.value.status == 404
    assert [e.name for e in reg.take_released()] == ["acme/two"]
    reg.release(held)
    assert [e.name for e in reg.take_released()] == ["acme/one"] and not held.ready
    reg.check_integrity()


def test_concurrent_first_requests_share_one_load(tmp_path: Path) -> None:
    root = tmp_path / "loras"
    _touch_adapter(root / "acme" / "one")
    _touch_adapter(root / "acme" / "bad")
    loader = FakeLoader(delay_s=0.05)
    reg = _registry(root, 4, loader)
    entries = [reg.lookup("acme/one") for _ in range(8)]
    assert all(e is entries[0] for e in entries)
    for e in entries:
        reg.start_load(e)                            # eight pumps while the read is in flight
    while reg.num_loading:
        reg.wait_for_loads(0.1)
    assert entries[0].ready and list(loader.reads.values()) == [1]
    bad = reg.lookup("acme/bad")
    reg.start_load(bad)
    while reg.num_loading:
        reg.wait_for_loads(0.1)
    assert bad.error is not None and reg.get("acme/bad") is None
    raised = []
    for _ in range(3):                               # remembered: no new read until the files change
        with pytest.raises(AdapterError) as excinfo:
            reg.lookup("acme/bad")
        raised.append(excinfo.value)
    assert loader.reads[str(root / "acme" / "bad")] == 1
    # a fresh exception each time: one remembered object raised again would grow one shared traceback
    assert len({id(e) for e in raised}) == 3 and {e.code for e in raised} == {"corrupt_adapter_weights"}
    time.sleep(0.01)
    _touch_adapter(root / "acme" / "bad", tag="changed")
    assert reg.lookup("acme/bad") is not None
    reg.check_integrity()


def test_request_resolved_before_a_failed_first_read_gets_its_error(tmp_path: Path) -> None:
    """Two requests resolve a directory adapter whose files are corrupt; the first one's read fails (and retires
    the entry) before the second is admitted: the second gets that read's 400, not a 404 for an unloaded name."""
    root = tmp_path / "loras"
    _touch_adapter(root / "acme" / "bad")
    reg = _registry(root, 4, FakeLoader())
    first, second = reg.lookup("acme/bad"), reg.lookup("acme/bad")
    assert first is second
    reg.acquire(first)
    reg.start_load(first)
    while reg.num_loading:
        reg.wait_for_loads(0.1)
    with pytest.raises(AdapterError) as excinfo:
        reg.acquire(second)
    assert (excinfo.value.code, excinfo.value.status) == ("corrupt_adapter_weights", 400)
    reg.release(first)
    reg.take_released()
    reg.check_integrity()


def test_directory_names_stay_inside(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    _touch_adapter(root / "acme" / "a")
    _touch_adapter(outside / "evil")
    (root / "out").symlink_to(outside / "evil")
    (root / "inner").symlink_to(root / "acme" / "a")          # unprefixed, into acme's folder: refused
    (root / "acme" / "alias").symlink_to("a")                 # a symlink that stays inside acme's folder is fine
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text("{}")
    (root / "half" / "adapter_model.safetensors").symlink_to(outside / "evil" / "adapter_model.safetensors")
    (root / "acme" / "up").symlink_to("../../outside/evil")
    d = LoraDirectory(str(root))
    assert d.resolve("acme/a") is not None and d.resolve("acme/alias") is not None
    assert d.resolve("acme/alias").path == str((root / "acme" / "a").resolve())
    for name in ("../outside/evil", "acme/../../outside/evil", str(outside / "evil"), "/acme/a", "out", "half", "inner",
                 "acme/up", "acme", "acme/./a", "acme//a", "acme\\a", "", "acme/a\x00", "acme/a/adapter_config.json"):
        assert d.resolve(name) is None, name
    assert d.scan() == ["acme/a"]                              # symlinks are not followed by the scan


def test_scan_is_bounded(tmp_path: Path) -> None:
    for i in range(30):
        _touch_adapter(tmp_path / f"d{i:02d}")
    d = LoraDirectory(str(tmp_path), max_scan_dirs=10)
    assert 0 < len(d.scan()) <= 10
    assert LoraDirectory(str(tmp_path)).scan() == [f"d{i:02d}" for i in range(30)]


@pytest.mark.parametrize("name", ["../x", "acme/../x", "/x", "x/", ".", "acme//a", "a\x00b", "a\\b", "a,b", "n" * 513])
def test_loaded_names_follow_the_directory_names_rules(tmp_path: Path, name: str) -> None:
    """An admin load (or --lora-modules) took any non-empty string as a name, a 30 MB one or one with a NUL
    included (each shown on /v1/models, /metrics and every log line): a served name now follows the rules a
    --lora-dir name does (at most 512 characters, no NUL or backslash, no leading '/', no empty, '.' or '..' part),
    else a 400 that does not echo it."""
    _touch_adapter(tmp_path / "a")
    (tmp_path / "dirs").mkdir()
    reg = _registry(tmp_path / "dirs", 4, FakeLoader())
    with pytest.raises(AdapterError) as info:
        reg.load(name, str(tmp_path / "a"))
    assert info.value.code == "invalid_adapter_name" and info.value.status == 400, info.value
    assert len(info.value.message) < 300, info.value   # the 513 characters are not echoed
    assert reg.load("acme/support-v2", str(tmp_path / "a")).name == "acme/support-v2"


def test_a_replaced_copy_makes_room_for_its_replacement(tmp_path: Path) -> None:
    """load_inplace of a resident, unheld adapter with the host copies full: the retired copy stayed counted until
    the engine's next step, so the new one evicted another live adapter (read from disk again on its next request)."""
    for name in ("x", "a1", "a2"):
        _touch_adapter(tmp_path / name, name)
    loader = FakeLoader(delay_s=0)
    (tmp_path / "dir").mkdir()
    reg = _registry(tmp_path / "dir", 2, loader)
    x = reg.load("x", str(tmp_path / "x"))
    reg.load("a", str(tmp_path / "a1"))
    new = reg.load("a", str(tmp_path / "a2"), replace=True)
    assert reg.is_ready(x) and reg.is_ready(new)
    assert reg.num_host == 2
    reg.check_integrity()
    assert [e.name for e in reg.take_released()] == ["a"]
    assert reg.is_ready(x) and reg.num_host == 2
