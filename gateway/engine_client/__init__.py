"""The API process's handle on the engine when it runs in its own process (`--engine-process on`)."""
