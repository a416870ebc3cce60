"""The engine core in its own process (issue 27): `proc.py` runs the step loop, `protocol.py` is the wire format.

The API process (`gateway/engine_client/client.py`) talks to it over two ZMQ PUSH/PULL sockets: one batched
`EngineInput` per event-loop turn towards the engine, one `EngineOutput` per engine step back.
"""
