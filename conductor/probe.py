"""Exit 0 when the Conductor at ``--address`` serves (it leads), 1 otherwise: a Kubernetes readiness probe.

With several Conductor replicas on one Redis, only the leader answers (conductor/leader.py);
the probe keeps the standbys out of the Service's endpoints, so calls reach the leader
alone, and a standby becomes ready the moment it takes over.

    python -m conductor.probe --address 127.0.0.1:7000 [--timeout 1]
"""

from __future__ import annotations

import argparse
import sys

import grpc

from mooncake import tls
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:7000", help="the Conductor's gRPC address")
    p.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for its answer")
    args = p.parse_args(argv)
    with tls.grpc_channel(args.address) as channel:
        try:
            pb_grpc.ConductorStub(channel).ListInstances(pb.ListInstancesRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(
                f"the Conductor at {args.address} does not serve: {e.code().name} {e.details() or ''}", file=sys.stderr
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
