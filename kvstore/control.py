"""The pool node's control fast path: its hot RPCs over framed sockets (mooncake/runtime/framed.py) beside gRPC.

The calls a worker makes per request (Get, Release, Reserve, Commit, Abort, Lookup, Pin,
Stats; ReleaseOwner once at its start) travel this way, answered by the same
:class:`~kvstore.service.KVStoreServicer` methods with the same error codes; everything
else (Pull, the event stream) stays on gRPC.
"""

from __future__ import annotations

from mooncake.runtime.framed import Methods
from protos import kvstore_pb2 as pb

# method id -> (servicer method name, request type, response type); ids are the wire format
METHODS: Methods = {
    1: ("Get", pb.GetRequest, pb.GetResponse),
    2: ("Release", pb.ReleaseRequest, pb.ReleaseResponse),
    3: ("Reserve", pb.ReserveRequest, pb.ReserveResponse),
    4: ("Commit", pb.CommitRequest, pb.CommitResponse),
    5: ("Abort", pb.AbortRequest, pb.AbortResponse),
    6: ("Lookup", pb.LookupRequest, pb.LookupResponse),
    7: ("Pin", pb.PinRequest, pb.PinResponse),
    8: ("Stats", pb.StatsRequest, pb.StatsResponse),
    9: ("ReleaseOwner", pb.ReleaseOwnerRequest, pb.ReleaseOwnerResponse),
}
METHOD_IDS = {name: mid for mid, (name, _, _) in METHODS.items()}
