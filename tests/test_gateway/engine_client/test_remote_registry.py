"""The API process's adapter mirror (`RemoteRegistry`): a `--lora-dir` adapter whose first read failed in the
engine is remembered even while the mirror still lists the engine's directory entry (the event retiring it
can arrive a message after the failed request's delta), so later requests get the 400 before any byte."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapters.errors import AdapterError
from adapters.registry.lora_dirs import CONFIG_FILE, WEIGHTS_FILE
from gateway.engine_client.registry_mirror import RemoteRegistry


def _no_commands(op: str, args: tuple) -> None:
    raise AssertionError(f"no engine command expected, got {op}")


@pytest.fixture()
def lora_dir(tmp_path: Path) -> Path:
    for name in ("corrupt", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / CONFIG_FILE).write_text("{}")
        (tmp_path / name / WEIGHTS_FILE).write_bytes(b"not safetensors")
    return tmp_path


def corrupt_error() -> AdapterError:
    return AdapterError("cannot read adapter 'corrupt'", code="corrupt_adapter_weights", status=400)


def test_failure_is_remembered_while_the_mirror_still_lists_the_directory_entry(lora_dir: Path) -> None:
    reg = RemoteRegistry(_no_commands, [str(lora_dir)])
    reg.sync([("corrupt", reg.dirs.resolve("corrupt").path, "lora-1", 0)])   # the engine registered it
    assert reg.get("corrupt") is not None and reg.get("corrupt").path == reg.dirs.resolve("corrupt").path
    reg.remember_failure("corrupt", corrupt_error())     # the failed request's delta, before the retire event
    reg.sync([])                                          # the retire event
    with pytest.raises(AdapterError) as err:
        reg.lookup("corrupt")
    assert err.value.status == 400 and err.value.code == "corrupt_adapter_weights"
    assert reg.lookup("other") is not None                # another folder is untouched
    (lora_dir / "corrupt" / WEIGHTS_FILE).write_bytes(b"new files")   # fixed files: read again
    assert reg.lookup("corrupt") is not None


def test_an_admin_adapter_of_another_folder_does_not_mark_the_directory(lora_dir: Path, tmp_path_factory) -> None:
    reg = RemoteRegistry(_no_commands, [str(lora_dir)])
    elsewhere = tmp_path_factory.mktemp("admin")
    reg.sync([("corrupt", str(elsewhere), "lora-7", 0)])  # an admin load of that name, from another folder
    reg.remember_failure("corrupt", corrupt_error())
    reg.sync([])                                          # admin-unloaded: the directory's entry resolves again
    assert reg.lookup("corrupt") is not None
