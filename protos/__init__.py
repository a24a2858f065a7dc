""".proto files and their generated modules. Empty until the first gRPC service (issue 3)."""
