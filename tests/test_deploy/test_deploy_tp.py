"""Static checks of the multi-GPU manifest variant `deploy-tp/` (a kustomize overlay on `deploy/`): the
model-server args parse with our CLI, `--tensor-parallel-size` equals the pod's GPU count, NCCL gets a
memory-backed /dev/shm, and the overlay builds."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser

OVERLAY = Path(__file__).resolve().parents[2] / "deploy-tp"


def _patched_container() -> tuple[dict[str, Any], dict[str, Any]]:
    (dep,) = [d for d in yaml.safe_load_all((OVERLAY / "loraplex-deployment-tp.yaml").read_text()) if d]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, container


def test_overlay_args_parse_and_match_the_gpu_count() -> None:
    dep, c = _patched_container()
    config = build_parser().parse_args(["serve", *[str(a) for a in c["args"]]])   # (files exist only in the pod)
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == int(c["resources"]["requests"]["nvidia.com/gpu"]) > 1
    assert config.tensor_parallel_size == gpus and config.device == "cuda"
    (base,) = [d for d in yaml.safe_load_all((OVERLAY.parent / "deploy" / "loraplex-deployment.yaml").read_text()) if d]
    base_args = build_parser().parse_args(["serve", *[str(a) for a in base["spec"]["template"]["spec"]["containers"][0]
                                                      ["args"]]])
    # the patch replaces the args list whole: the ports the base's probes, pool and picker use must stay
    assert (config.port, config.metrics_port) == (base_args.port, base_args.metrics_port)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_overlay_builds_on_the_base() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    deps = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"
            and d["metadata"]["name"] == "loraplex"]
    (c,) = deps[0]["spec"]["template"]["spec"]["containers"]
    args = [str(a) for a in c["args"]]
    assert args[args.index("--tensor-parallel-size") + 1] == str(c["resources"]["limits"]["nvidia.com/gpu"])
    assert {"/models", "/adapters", "/dev/shm"} <= {m["mountPath"] for m in c["volumeMounts"]}
