"""Starting and stopping the server: config, vLLM flags, engine and uvicorn, shared state, draining, lost workers."""
