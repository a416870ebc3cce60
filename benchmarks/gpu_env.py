"""What a GPU run ran with: torch, triton, CUDA, the driver, the GPU, the project's Python dependencies, and the
device's two ceilings (read bandwidth, bf16 matrix rate; benchmarks/ceilings.py). The env stage of gpu_run.py.

GPU images may carry another torch than the pin (2.11 was measured against 2.13 here): every figure of a run is
read against these versions.
Usage: python benchmarks/gpu_env.py [--name NAME] [--dry-run]
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from ceilings import copy_bandwidth, l2_bytes, matmul_flops, read_bandwidth
from common import environment, write_results

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub", "outlines_core",
            "xgrammar", "apache-tvm-ffi", "starlette", "uvicorn", "pydantic", "pydantic_core", "jsonschema",
            "pyzmq", "msgspec", "prometheus_client", "httpx", "numpy", "peft", "pytest", "compressed-tensors")


def nvidia_smi() -> dict[str, str | None]:
    """Driver version and GPU name as nvidia-smi reports them (None where it is absent)."""
    if shutil.which("nvidia-smi") is None:
        return {"driver": None, "gpu_name": None}
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    driver, name = (out[0].split(", ", 1) + [None])[:2] if out else (None, None)
    return {"driver": driver, "gpu_name": name}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dry-run", action="store_true", help="the CPU's ceilings, small buffers")
    ap.add_argument("--name", default="gpu_env")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    small = (8 << 20) if device.type == "cpu" else None
    data = {**environment(), **nvidia_smi(), "platform": platform.platform(), "packages": versions(),
            "device": str(device), "dry_run": args.dry_run,
            "read_bandwidth_gb_s": read_bandwidth(device, small) / 1e9,
            "copy_bandwidth_gb_s": copy_bandwidth(device, small) / 1e9,
            "matmul_tflops": matmul_flops(device) / 1e12, "l2_bytes": l2_bytes(device),
            "num_sms": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None}
    table = [("torch / triton / CUDA", f"{data['torch']} / {data['triton']} / {data['cuda']}"),
             ("driver / GPU", f"{data['driver']} / {data['gpu_name'] or data['gpu']}"),
             ("read / copy bandwidth", f"{data['read_bandwidth_gb_s']:.0f} / {data['copy_bandwidth_gb_s']:.0f} GB/s"),
             ("bf16 matrix rate", f"{data['matmul_tflops']:.0f} TFLOP/s"),
             ("missing packages", ", ".join(k for k, v in data["packages"].items() if v is None) or "none")]
    write_results(args.name, data, table)


if __name__ == "__main__":
    main()
