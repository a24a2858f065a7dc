"""The pyverbs structures the rdma backend posts, built from transfer/verbs.py's decisions: a queue pair's
attributes and mask for each state change, access flags, and a chain of RDMA work requests. They build structs
only (no device needed), from the pyverbs modules given (``v``: transfer/rdma.py's ``_pyverbs()``), so the tests
build them on the simulated fabric (tests/fakeverbs.py) and check each constant against an installed pyverbs.
"""

from __future__ import annotations

import numpy as np

from transfer.verbs import Transition

# every libibverbs constant this backend uses (tests/test_rdma.py resolves each against the installed pyverbs)
CONSTANTS = (
    "IBV_QPT_RC",
    "IBV_SEND_SIGNALED",
    "IBV_WR_RDMA_READ",
    "IBV_WR_RDMA_WRITE",
    "IBV_QPS_INIT",
    "IBV_QPS_RTR",
    "IBV_QPS_RTS",
    "IBV_QPS_ERR",
    "IBV_QP_STATE",
    "IBV_QP_PKEY_INDEX",
    "IBV_QP_PORT",
    "IBV_QP_ACCESS_FLAGS",
    "IBV_QP_AV",
    "IBV_QP_PATH_MTU",
    "IBV_QP_DEST_QPN",
    "IBV_QP_RQ_PSN",
    "IBV_QP_MAX_DEST_RD_ATOMIC",
    "IBV_QP_MIN_RNR_TIMER",
    "IBV_QP_TIMEOUT",
    "IBV_QP_RETRY_CNT",
    "IBV_QP_RNR_RETRY",
    "IBV_QP_SQ_PSN",
    "IBV_QP_MAX_QP_RD_ATOMIC",
    "IBV_ACCESS_LOCAL_WRITE",
    "IBV_ACCESS_REMOTE_READ",
    "IBV_ACCESS_REMOTE_WRITE",
    "IBV_PORT_ACTIVE",
    "IBV_LINK_LAYER_ETHERNET",
    "IBV_WC_SUCCESS",
)


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too, which ctypes will not take)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def qp_attr(v: dict, t: Transition):
    """pyverbs' ``QPAttr`` and attribute mask for one state change (builds structs only: no device needed)."""
    attr = v["qp"].QPAttr(qp_state=getattr(v["e"], f"IBV_QPS_{t.state.value}"))
    for key, value in t.attrs.items():
        if key == "qp_access_flags":
            value = access_flags(v, value)
        elif key == "ah_attr":
            gr = None
            if "gr" in value:
                g = value["gr"]
                dgid = v["GID"](":".join(g["dgid"][i : i + 4] for i in range(0, 32, 4)))
                gr = v["GlobalRoute"](
                    dgid=dgid,
                    flow_label=g["flow_label"],
                    sgid_index=g["sgid_index"],
                    hop_limit=g["hop_limit"],
                    traffic_class=g["traffic_class"],
                )
            value = v["AHAttr"](
                dlid=value["dlid"],
                sl=value["sl"],
                src_path_bits=value["src_path_bits"],
                is_global=int(value["is_global"]),
                port_num=value["port_num"],
                gr=gr,
            )
        setattr(attr, key, value)
    mask = 0
    for name in t.mask:
        mask |= getattr(v["e"], f"IBV_QP_{name}")
    return attr, mask


def access_flags(v: dict, names: tuple[str, ...]) -> int:
    flags = 0
    for name in names:
        flags |= getattr(v["e"], f"IBV_ACCESS_{name}")
    return flags


def send_chain(v: dict, reqs: list[tuple], wr_ids: dict[int, int]) -> list:
    """The linked list of RDMA work requests for ``reqs`` ((job, opcode, local addr, lkey, remote addr, rkey, length));
    position i is signalled with wr_id ``wr_ids[i]`` when it is a key. Returns every request, head first (keep
    them referenced until posted: each links to the next by pointer)."""
    chain = []
    head = None
    for i in reversed(range(len(reqs))):  # built back to front: each links to the next
        _, opcode, laddr, lkey, raddr, rkey, n = reqs[i]
        flags = v["e"].IBV_SEND_SIGNALED if i in wr_ids else 0
        wr = v["wr"].SendWR(
            wr_id=wr_ids.get(i, 0),
            opcode=opcode,
            num_sge=1,
            sg=[v["wr"].SGE(laddr, n, lkey)],
            send_flags=flags,
            next_wr=head,
        )
        wr.set_wr_rdma(rkey, raddr)
        chain.append(wr)
        head = wr
    chain.reverse()
    return chain
