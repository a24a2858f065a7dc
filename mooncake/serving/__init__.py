"""What the workers share above the engine: the engine loop and its thread, the engines' factory, the workers' flags,
the KV layout on the wire, CUDA IPC, sampling and text on the wire, the gateway contract (types) and the error table
(status)."""
