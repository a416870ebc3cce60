"""A minimal keep-alive HTTP/1.1 client for benchmarks/serving_overhead.py, plus /proc CPU-time readers.

httpx spends several times the server's own per-request CPU; on a 2-core machine the client shares the cores
with the server, so the benchmark's client must be as cheap as it can be: raw asyncio streams, one pooled
connection per concurrent request, Content-Length and chunked bodies only.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


def _stat_cpu_s(stat_path: Path) -> float:
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS      # utime + stime


def proc_cpu_s(pid: int) -> float:
    try:
        return _stat_cpu_s(Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError):
        return 0.0


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid` and of its children, keyed 'pid/comm/tid' (comm is the thread's name)."""
    out: dict[str, float] = {}
    pids = [pid]
    try:
        pids += [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                text=True).stdout.split()]
    except OSError:
        pass
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                comm = (task / "comm").read_text().strip()
                tag = "main" if task.name == str(p) else comm
                out[f"{'api' if p == pid else 'child'}:{tag}:{task.name}"] = _stat_cpu_s(task / "stat")
            except (OSError, IndexError):
                continue
    return out


class HttpClient:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.model = ""

    async def _conn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._idle:
            return self._idle.pop()
        return await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()

    async def _request(self, method: str, path: str, body: bytes | None, on_chunk=None) -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        for attempt in range(2):   # a pooled connection the server closed (keep-alive timeout): a fresh one
            reader, writer = await (self._conn() if attempt == 0 else asyncio.open_connection(self.host, self.port))
            writer.write(head.encode() + b"\r\n" + (body or b""))
            try:
                status_line = await reader.readline()
            except ConnectionError:
                status_line = b""
            if status_line:
                break
            writer.close()
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        data = b""
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readline()).strip(), 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                data += chunk[:-2]
                if on_chunk is not None:
                    on_chunk(chunk[:-2])
        else:
            data = await reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, data

    async def get(self, path: str) -> tuple[int, bytes]:
        return await self._request("GET", path, None)

    async def wait_healthy(self, proc: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                status, _ = await self.get("/health")
                if status == 200:
                    _, models = await self.get("/v1/models")
                    self.model = json.loads(models)["data"][0]["id"]
                    await self.close()
                    return
            except OSError:
                pass
            self._idle.clear()
            await asyncio.sleep(0.3)
        raise RuntimeError("server not healthy")

    async def complete(self, prompt: list[int], max_tokens: int, stream: bool,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One greedy completion of `max_tokens` tokens; `extra`: further request fields (a server's own)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": stream, **(extra or {})}
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        first: list[float] = []

        def on_chunk(chunk: bytes) -> None:
            if not first and b'"text"' in chunk:
                first.append(time.perf_counter() - t0)

        status, data = await self._request("POST", "/v1/completions", json.dumps(body).encode(),
                                           on_chunk if stream else None)
        assert status == 200, (status, data[:300])
        if stream:
            usage = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")][-1]
            tokens = usage["usage"]["completion_tokens"]
            text = None
        else:
            reply = json.loads(data)
            tokens, text = reply["usage"]["completion_tokens"], reply["choices"][0]["text"]
        assert tokens == max_tokens, (tokens, max_tokens)
        return {"tokens": tokens, "ttft_s": first[0] if first else time.perf_counter() - t0, "text": text}
