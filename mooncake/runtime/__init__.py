"""What every process of the cluster runs on, below the engine, the pool and the Conductor: READY lines, signals and
a worker's gRPC serving (process), channels and their failure detection (channels), the Conductor link of workers and
pool nodes (conductor_link), the /metrics and /health server (status_http), and framed RPC (framed). Imports nothing of
the project above transfer/, protos/ and mooncake's own small modules (tls, faults, cliargs)."""
