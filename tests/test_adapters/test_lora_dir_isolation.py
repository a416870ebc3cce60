"""`--lora-dir` folders as tenant boundaries (issue 31): a name `P/...` is served only from inside `DIR/P` (a
real directory), an unprefixed name only from a first-level folder, whatever the symlinks (relative or
absolute targets, chains, links to folders or to files, links at the first level); everything else is absent.
The resolution and reading tests use only `LoraDirectory` / `AdapterRegistry`, so they run on the old code too
(where the cross-tenant cases are served with the other tenant's weights)."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapters.layers.dims import BaseModelDims
from adapters.errors import AdapterError
from adapters.registry.lora_dirs import LoraDirectories, LoraDirectory
from adapters.registry.registry import AdapterRegistry

DIMS = BaseModelDims(hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2, head_dim=4, num_layers=2,
                     vocab_size=32)


def write_adapter(folder: Path, fill: float, rank: int = 2) -> Path:
    """A valid PEFT adapter for DIMS (q_proj), every A entry equal to `fill`: which files were read shows."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(DIMS.num_layers):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.full((rank, 16), fill)
        tensors[f"{key}.lora_B.weight"] = torch.ones(16, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj"], "bias": "none"}))
    return folder


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """<tmp>/loras/{acme,globex}/..., <tmp>/outside/evil, with every kind of link the tests need."""
    root, outside = tmp_path / "loras", tmp_path / "outside"
    write_adapter(root / "acme" / "own", 1.0)
    write_adapter(root / "acme" / "teams" / "t1" / "x", 2.0)
    write_adapter(root / "globex" / "secret", 3.0)
    write_adapter(root / "shared", 4.0)                     # unprefixed: a first-level adapter folder
    write_adapter(outside / "evil", 5.0)
    acme, globex = root / "acme", root / "globex"
    # inside acme's folder: allowed
    (acme / "alias").symlink_to("own")                                      # relative
    (acme / "abs-alias").symlink_to(acme / "own")                           # absolute
    (acme / "chain1").symlink_to("chain2")
    (acme / "chain2").symlink_to("./teams/../own")                          # a chain, with ".." inside
    (acme / "team").symlink_to("teams/t1")                                  # a folder link, then a name below
    (acme / "split").mkdir()
    (acme / "split" / "adapter_config.json").symlink_to("../own/adapter_config.json")   # file links inside acme
    (acme / "split" / "adapter_model.safetensors").symlink_to(acme / "own" / "adapter_model.safetensors")
    # across tenants' folders: refused
    (acme / "link-globex").symlink_to("../globex/secret")                   # relative
    (acme / "abs-globex").symlink_to(globex / "secret")                     # absolute
    (acme / "via1").symlink_to("via2")
    (acme / "via2").symlink_to("../globex/secret")                          # a chain ending in globex
    (acme / "gx").symlink_to("../globex")                                   # a folder link into globex
    (acme / "bounce").symlink_to("../globex/back")                          # through globex and back to acme
    (globex / "back").symlink_to("../acme/own")
    (acme / "half").mkdir()
    (acme / "half" / "adapter_config.json").write_text((acme / "own" / "adapter_config.json").read_text())
    (acme / "half" / "adapter_model.safetensors").symlink_to("../../globex/secret/adapter_model.safetensors")
    write_adapter(acme / "tok", 1.0)
    (acme / "tok" / "added_tokens.json").symlink_to(globex / "secret" / "adapter_config.json")
    # out of the root: refused
    (acme / "out").symlink_to("../../outside/evil")
    (acme / "abs-out").symlink_to(outside / "evil")
    # links at the first level: refused as a prefix
    (root / "acme2").symlink_to(globex)                                     # <root>/acme2 -> <root>/globex
    (root / "acme3").symlink_to("acme")                                     # even to a sibling tenant folder
    (root / "outer").symlink_to(outside)
    # unprefixed names
    (root / "latest").symlink_to("shared")                                  # a sibling first-level folder: ok
    (root / "peek").symlink_to("acme/own")                                  # into a tenant's folder: refused
    (root / "peek-abs").symlink_to(globex / "secret")
    (root / "mixed").mkdir()
    (root / "mixed" / "adapter_config.json").write_text((acme / "own" / "adapter_config.json").read_text())
    (root / "mixed" / "adapter_model.safetensors").symlink_to("../acme/own/adapter_model.safetensors")
    (root / "reuse").mkdir()                                                # files from another folder: refused
    (root / "reuse" / "adapter_config.json").write_text((acme / "own" / "adapter_config.json").read_text())
    (root / "reuse" / "adapter_model.safetensors").symlink_to("../shared/adapter_model.safetensors")
    return root


ALLOWED = {"acme/own": "acme/own", "acme/alias": "acme/own", "acme/abs-alias": "acme/own",
           "acme/chain1": "acme/own", "acme/team/x": "acme/teams/t1/x", "acme/teams/t1/x": "acme/teams/t1/x",
           "acme/split": "acme/split", "globex/secret": "globex/secret", "shared": "shared", "latest": "shared"}
CROSS_TENANT = ["acme/link-globex", "acme/abs-globex", "acme/via1", "acme/gx/secret", "acme/bounce", "acme/half",
                "acme/tok", "acme2/secret", "acme3/own", "peek", "peek-abs", "mixed", "reuse"]
OUT_OF_ROOT = ["acme/out", "acme/abs-out", "outer/evil", "acme/../../outside/evil"]


def test_links_inside_a_tenant_folder_are_served(tree: Path) -> None:
    d = LoraDirectory(str(tree))
    for name, real in ALLOWED.items():
        loc = d.resolve(name)
        assert loc is not None, name
        assert loc.path == str((tree / real).resolve()), name


@pytest.mark.parametrize("name", CROSS_TENANT + OUT_OF_ROOT)
def test_links_leaving_the_tenant_folder_are_absent(tree: Path, name: str) -> None:
    assert LoraDirectory(str(tree)).resolve(name) is None
    assert LoraDirectories([str(tree)]).resolve(name) is None


def test_scan_lists_only_what_resolves(tree: Path) -> None:
    d = LoraDirectory(str(tree))
    names = d.scan()
    assert set(names) <= set(ALLOWED), names
    assert {"acme/own", "acme/teams/t1/x", "globex/secret", "shared"} <= set(names)
    assert all(d.resolve(n) is not None for n in names)


def test_a_first_level_folder_swapped_for_a_link_is_refused(tree: Path) -> None:
    d = LoraDirectory(str(tree))
    assert d.resolve("acme/own") is not None
    os.rename(tree / "acme", tree / "acme-real")
    (tree / "acme").symlink_to("acme-real")                 # <root>/acme must be a real directory
    assert d.resolve("acme/own") is None and d.resolve("acme/alias") is None


def _registry(root: Path) -> AdapterRegistry:
    return AdapterRegistry(DIMS, 8, 4, lora_dirs=[str(root)])


def _load(reg: AdapterRegistry, name: str):
    """Registers `name` and reads it through the loader pool; the entry (its `adapter` or its `error`)."""
    entry = reg.lookup(name)
    assert entry is not None, name
    reg.start_load(entry)
    deadline = time.monotonic() + 30
    while entry.loading or (entry.adapter is None and entry.error is None):
        assert time.monotonic() < deadline
        reg.wait_for_loads(0.05)
    return entry


def _fill(entry) -> float:
    return float(entry.adapter.modules[(0, "q_proj")].lora_a[0, 0])


def test_reads_serve_the_folders_own_weights(tree: Path) -> None:
    reg = _registry(tree)
    try:
        assert _fill(_load(reg, "acme/alias")) == 1.0 and _fill(_load(reg, "acme/split")) == 1.0
        assert _fill(_load(reg, "acme/team/x")) == 2.0 and _fill(_load(reg, "latest")) == 4.0
        for name in CROSS_TENANT + OUT_OF_ROOT:
            assert reg.lookup(name) is None, name
    finally:
        reg.shutdown()


@pytest.mark.parametrize("swap", ["folder", "file", "parent", "abs-folder"])
def test_a_link_swapped_after_resolution_is_caught_when_read(tree: Path, swap: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry resolves (and is re-resolved right before its read) while `acme/x` is acme's own folder; then,
    before the files are opened, part of its path becomes a link into globex's folder. The read must fail as
    an absent model, never serve globex's weights."""
    acme = tree / "acme"
    write_adapter(acme / "box" / "x", 6.0)
    name = "acme/box/x"
    reg = _registry(tree)
    relocate = LoraDirectories.relocate

    def relocate_then_swap(self, loc):
        found = relocate(self, loc)
        if swap == "folder":
            os.rename(acme / "box" / "x", acme / "x-old")
            (acme / "box" / "x").symlink_to("../../globex/secret")
        elif swap == "abs-folder":
            os.rename(acme / "box" / "x", acme / "x-old")
            (acme / "box" / "x").symlink_to(tree / "globex" / "secret")
        elif swap == "file":
            os.rename(acme / "box" / "x" / "adapter_model.safetensors", acme / "old.safetensors")
            (acme / "box" / "x" / "adapter_model.safetensors").symlink_to(
                "../../../globex/secret/adapter_model.safetensors")
        else:
            os.rename(acme / "box", acme / "box-old")
            (acme / "box").symlink_to("../globex/box")
            (tree / "globex" / "box").mkdir()
            (tree / "globex" / "box" / "x").symlink_to("../secret")
        return found

    monkeypatch.setattr(LoraDirectories, "relocate", relocate_then_swap)
    try:
        entry = _load(reg, name)
        assert entry.adapter is None, f"served weights {_fill(entry)} through a swapped link"
        assert entry.error.status == 404 and entry.error.code == "model_not_found", entry.error
        assert str(tree) not in entry.error.message
    finally:
        reg.shutdown()


def test_a_swap_after_the_files_are_open_reads_the_opened_files(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once open, the descriptors are the folder's own files: a link swapped in during the read changes nothing
    that is read (and the fingerprint taken from the open files matches the resolution's)."""
    from adapters.peft import loader as peft_loader

    acme = tree / "acme"
    write_adapter(acme / "y", 7.0)
    reg = _registry(tree)
    read_weights = peft_loader._read_weights

    def swap_then_read(files):
        os.rename(acme / "y", acme / "y-old")
        (acme / "y").symlink_to("../globex/secret")
        return read_weights(files)

    monkeypatch.setattr(peft_loader, "_read_weights", swap_then_read)
    try:
        entry = _load(reg, "acme/y")
        assert entry.error is None and _fill(entry) == 7.0
    finally:
        reg.shutdown()


def test_a_fifo_in_place_of_the_weights_does_not_block(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acme = tree / "acme"
    write_adapter(acme / "z", 8.0)
    reg = _registry(tree)
    relocate = LoraDirectories.relocate

    def relocate_then_fifo(self, loc):
        found = relocate(self, loc)
        os.unlink(acme / "z" / "adapter_model.safetensors")
        os.mkfifo(acme / "z" / "adapter_model.safetensors")
        return found

    monkeypatch.setattr(LoraDirectories, "relocate", relocate_then_fifo)
    try:
        entry = _load(reg, "acme/z")
        assert entry.adapter is None and entry.error is not None
    finally:
        reg.shutdown()


@pytest.mark.parametrize("damage, code", [
    ("corrupt", "corrupt_adapter_weights"), ("rank", "lora_rank_too_large"), ("shape", "adapter_shape_mismatch"),
    ("config", "invalid_adapter"), ("unreadable", "corrupt_adapter_weights")])
def test_load_errors_name_no_path(tree: Path, damage: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a tenant reads about its own broken adapter: the reason and the code, no filesystem path."""
    folder = write_adapter(tree / "acme" / "broken", 1.0, rank=16 if damage == "rank" else 2)
    weights = folder / "adapter_model.safetensors"
    if damage == "corrupt":
        weights.write_bytes(b"\xff" * 8 + b"not a safetensors file")
    elif damage == "shape":
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 15),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(16, 2)}, str(weights))
    elif damage == "config":
        (folder / "adapter_config.json").write_text("{not json")
    elif damage == "unreadable":   # an OSError names the file it failed on: the message must not
        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(weights))
        monkeypatch.setattr("safetensors.torch.load_file", denied)
        monkeypatch.setattr("adapters.peft.loader.load_file", denied, raising=False)
    reg = _registry(tree)
    try:
        entry = _load(reg, "acme/broken")
        assert entry.error is not None and entry.error.code == code, entry.error
        assert str(tree.parent) not in entry.error.message and "loras" not in entry.error.message, entry.error
    finally:
        reg.shutdown()


@pytest.mark.parametrize("damage, code", [("config", "invalid_adapter"), ("removed", "adapter_not_found")])
def test_reread_errors_of_a_path_adapter_name_no_path(tmp_path: Path, damage: str, code: str) -> None:
    """An operator-loaded adapter (by path) whose host copy was dropped is read again for a tenant's request:
    a failure of that read reaches the tenant without the path."""
    folder = write_adapter(tmp_path / "srv" / "admin-x", 1.0)
    reg = AdapterRegistry(DIMS, 8, 1, lora_dirs=[])
    try:
        entry = reg.load("x", str(folder))
        reg.load("y", str(write_adapter(tmp_path / "srv" / "admin-y", 2.0)))   # evicts x's host copy
        assert entry.adapter is None
        if damage == "config":
            (folder / "adapter_config.json").write_text("{not json")
        else:
            shutil.rmtree(folder)
        entry.fingerprint = None      # as if the change raced the check: the read itself fails, path-free
        reg.start_load(entry)
        deadline = time.monotonic() + 30
        while entry.loading or entry.error is None:
            assert time.monotonic() < deadline
            reg.wait_for_loads(0.05)
        assert entry.error.code == code and str(tmp_path) not in entry.error.message, entry.error
    finally:
        reg.shutdown()


def test_folder_files_never_open_outside(tree: Path) -> None:
    """The reader itself: a location whose files moved out of the area is refused at open."""
    from adapters.registry.folder_files import FolderFiles, open_beneath

    d = LoraDirectory(str(tree))
    loc = d.resolve("acme/own")
    with FolderFiles(loc) as files:
        fp = files.fingerprint()
        assert fp == loc.fingerprint
        with files.open("adapter_config.json") as f:
            assert json.loads(f.read())["r"] == 2
        with files.open("adapter_config.json") as f:         # each open starts at the beginning
            assert json.loads(f.read())["r"] == 2
        assert files.open("added_tokens.json") is None
    with pytest.raises(OSError):
        open_beneath(str(tree), str(tree / "acme" / "alias" / "adapter_config.json"))   # a link on the way
    with pytest.raises(OSError):
        open_beneath(str(tree / "acme"), str(tree / "globex" / "secret" / "adapter_config.json"))
    os.rename(tree / "acme" / "own", tree / "acme" / "own-old")
    (tree / "acme" / "own").symlink_to("../globex/secret")
    with pytest.raises(AdapterError) as err, FolderFiles(loc) as files:
        files.fingerprint()
    assert err.value.status == 404 and err.value.code == "model_not_found"


@pytest.mark.parametrize("swap", ["folder", "file"])
def test_a_swap_between_the_check_and_the_open_fails_the_open(tree: Path, swap: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The narrowest window: the file's real path was checked (`locate_file`), then a link is swapped in
    before `open`. Opening walks that real path without following links, so it fails: no string check after
    the fact is relied on."""
    from adapters.registry import folder_files

    acme = tree / "acme"
    write_adapter(acme / "w", 9.0)
    loc = LoraDirectory(str(tree)).resolve("acme/w")
    locate = folder_files.locate_file

    def locate_then_swap(loc_, fname):
        real = locate(loc_, fname)
        if fname != "adapter_model.safetensors":
            return real
        if swap == "folder":
            os.rename(acme / "w", acme / "w-old")
            (acme / "w").symlink_to("../globex/secret")
        else:
            os.rename(acme / "w" / fname, acme / "w-weights")
            (acme / "w" / fname).symlink_to(f"../../globex/secret/{fname}")
        return real

    monkeypatch.setattr(folder_files, "locate_file", locate_then_swap)
    with pytest.raises(AdapterError) as err, folder_files.FolderFiles(loc) as files:
        files.fingerprint()
    assert err.value.status == 404 and err.value.code == "model_not_found"


def test_an_unexpected_read_failure_names_no_path(tree: Path) -> None:
    """A loader failing with something else than an AdapterError (here an OSError naming a file): the request
    gets the adapter's name and the error's type, the server log the rest."""
    secret = str(tree / "globex" / "secret" / "adapter_model.safetensors")

    def failing_loader(source, dims, rank):
        raise OSError(5, "Input/output error", secret)

    reg = AdapterRegistry(DIMS, 8, 4, loader=failing_loader, lora_dirs=[str(tree)])
    try:
        entry = _load(reg, "acme/own")
        assert entry.error is not None and entry.error.status == 400
        assert str(tree.parent) not in entry.error.message and "globex" not in entry.error.message, entry.error
        assert "acme/own" in entry.error.message
    finally:
        reg.shutdown()
