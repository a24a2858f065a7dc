"""What the gateway and the workers share: generation requests and chunks, the backend interface, the engine loop."""
