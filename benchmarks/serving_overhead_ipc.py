"""IPC for the engine-core boundary: ZMQ PUSH/PULL (ipc://) vs a multiprocessing Pipe, msgspec-msgpack vs pickle.

A child process echoes every message back; the parent sends `--num` step outputs of `--batch` deltas each (one
token and a few characters per delta, as a decode step makes) and measures the round trip per message, wall
and the parent's CPU. Usage: python benchmarks/serving_overhead_ipc.py [--num 2000] [--batch 32]
"""
from __future__ import annotations

import argparse
import multiprocessing
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import scratch_dir, write_results   # noqa: E402
from core.engine_core.protocol import OUTPUT_DECODER, OUTPUT_ENCODER, Delta, EngineOutput   # noqa: E402


def step_output(batch: int, step: int) -> EngineOutput:
    return EngineOutput([Delta(f"cmpl-{i:032x}-0", [step % 500], " tok", False, None, 200, step, 0, None)
                         for i in range(batch)])


def zmq_echo(in_addr: str, out_addr: str) -> None:
    import zmq
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    while True:
        msg = pull.recv(copy=False)
        if len(msg) == 0:
            return
        push.send(msg, copy=False)


def pipe_echo(conn) -> None:   # noqa: ANN001
    while True:
        msg = conn.recv_bytes()
        if not msg:
            return
        conn.send_bytes(msg)


def run(transport: str, codec: str, msgs: list[EngineOutput]) -> dict[str, float]:
    enc = (lambda m: OUTPUT_ENCODER.encode(m)) if codec == "msgpack" else (lambda m: pickle.dumps(m, 5))
    dec = (lambda b: OUTPUT_DECODER.decode(b)) if codec == "msgpack" else pickle.loads
    ctx = multiprocessing.get_context("spawn")
    if transport == "zmq":
        import zmq
        d = scratch_dir("loraplex_ipc_")      # the two sockets; removed when this run exits
        zctx = zmq.Context()
        push, pull = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
        push.bind(f"ipc://{d}/a")
        pull.bind(f"ipc://{d}/b")
        child = ctx.Process(target=zmq_echo, args=(f"ipc://{d}/a", f"ipc://{d}/b"))
        send, recv = (lambda b: push.send(b, copy=False)), (lambda: pull.recv(copy=False).buffer)
    else:
        a, b = ctx.Pipe()
        child = ctx.Process(target=pipe_echo, args=(b,))
        send, recv = a.send_bytes, a.recv_bytes
    child.start()
    send(enc(msgs[0]))
    dec(recv())   # connected
    t0, c0 = time.perf_counter(), time.process_time()
    for m in msgs:
        send(enc(m))
        dec(recv())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    send(b"")
    child.join(5)
    return {"round_trip_us": 1e6 * wall / len(msgs), "parent_cpu_us": 1e6 * cpu / len(msgs),
            "bytes": len(enc(msgs[0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    msgs = [step_output(args.batch, s) for s in range(args.num)]
    results, table = {}, []
    for transport in ("zmq", "pipe"):
        for codec in ("msgpack", "pickle"):
            r = run(transport, codec, msgs)
            results[f"{transport}_{codec}"] = r
            table.append((f"{transport} + {codec}, {args.batch} deltas/message",
                          f"{r['round_trip_us']:.0f} us round trip, {r['parent_cpu_us']:.0f} us parent CPU, "
                          f"{r['bytes']} bytes"))
    write_results("serving_overhead_ipc", results, table)


if __name__ == "__main__":
    main()
