"""The rdma backend's decisions (transfer/verbs.py), computed without a device: QP state changes, work-request
chunking, posting under a queue depth, and which jobs a completion finishes."""

from __future__ import annotations

import pytest

from transfer.verbs import CompletionLedger, PortInfo, QPSettings, QPState, post_rounds, rc_transitions, work_requests

GID_A = "fe800000000000000000000000000001"
GID_B = "00000000000000000000ffff0a000002"  # a RoCE v2 GID for 10.0.0.2


def port(qp: int, psn: int, *, lid: int = 0, gid: str = GID_A, mtu: int = 5, roce: bool = True) -> PortInfo:
    return PortInfo(lid=lid, gid=gid, qp_num=qp, psn=psn, mtu=mtu, roce=roce)


def test_roce_transitions_route_by_the_peers_gid_and_use_the_smaller_mtu():
    local, remote = port(11, 100, mtu=5), port(22, 200, gid=GID_B, mtu=3)
    init, rtr, rts = rc_transitions(local, remote, QPSettings(port_num=1, gid_index=3))
    assert [t.state for t in (init, rtr, rts)] == [QPState.INIT, QPState.RTR, QPState.RTS]
    assert init.attrs["qp_access_flags"] == ("LOCAL_WRITE", "REMOTE_READ", "REMOTE_WRITE")
    assert set(init.mask) == {"STATE", "PKEY_INDEX", "PORT", "ACCESS_FLAGS"}
    assert rtr.attrs["dest_qp_num"] == 22 and rtr.attrs["rq_psn"] == 200  # the peer's QP and its first PSN
    assert rtr.attrs["path_mtu"] == 3  # 1024 bytes: the smaller port's
    ah = rtr.attrs["ah_attr"]
    assert ah["is_global"] is True and ah["gr"]["dgid"] == GID_B and ah["gr"]["sgid_index"] == 3
    assert {"AV", "DEST_QPN", "RQ_PSN", "PATH_MTU", "MAX_DEST_RD_ATOMIC", "MIN_RNR_TIMER"} <= set(rtr.mask)
    assert rts.attrs["sq_psn"] == 100  # our own first PSN, which the peer was told
    assert {"SQ_PSN", "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "MAX_QP_RD_ATOMIC"} <= set(rts.mask)
    for t in (init, rtr, rts):  # every attribute set is named in the mask, and the other way round
        assert "STATE" in t.mask


def test_infiniband_transitions_route_by_lid_and_refuse_a_peer_without_one():
    _, rtr, _ = rc_transitions(port(1, 0, lid=7, roce=False), port(2, 0, lid=9, roce=False), QPSettings())
    assert (
        rtr.attrs["ah_attr"]["dlid"] == 9
        and rtr.attrs["ah_attr"]["is_global"] is False
        and "gr" not in rtr.attrs["ah_attr"]
    )
    with pytest.raises(ValueError, match="LID 0"):
        rc_transitions(port(1, 0, lid=7, roce=False), port(2, 0, lid=0, roce=False), QPSettings())
    with pytest.raises(ValueError, match="cannot be connected"):
        rc_transitions(port(1, 0, lid=7, roce=False), port(2, 0), QPSettings())


def test_outstanding_reads_are_capped_by_the_device():
    _, rtr, rts = rc_transitions(port(1, 0), port(2, 0), QPSettings(max_rd_atomic=16), max_rd_atomic=4)
    assert rtr.attrs["max_dest_rd_atomic"] == 4 and rts.attrs["max_rd_atomic"] == 4
    with pytest.raises(ValueError, match="no outstanding RDMA READ"):
        rc_transitions(port(1, 0), port(2, 0), QPSettings(max_rd_atomic=0))


def test_port_info_is_checked_and_travels_as_a_dict():
    p = port(5, 123)
    assert PortInfo.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="24 bits"):
        port(1, 1 << 24)
    with pytest.raises(ValueError, match="MTU"):
        port(1, 0, mtu=6)
    with pytest.raises(ValueError, match="hex"):
        port(1, 0, gid="fe80::1")


def test_work_requests_cut_each_span_to_the_max_message_and_keep_order():
    wrs = work_requests([(1000, 5000, 10), (2000, 9000, 25)], max_msg=10)
    assert [(w.job, w.local_addr, w.remote_addr, w.length) for w in wrs] == [
        (0, 1000, 5000, 10),
        (1, 2000, 9000, 10),
        (1, 2010, 9010, 10),
        (1, 2020, 9020, 5),
    ]
    assert sum(w.length for w in wrs) == 35
    with pytest.raises(ValueError):
        work_requests([(0, 0, 0)], 10)
    with pytest.raises(ValueError):
        work_requests([(0, 0, 5)], 0)


def test_posts_fit_the_free_send_queue_and_each_ends_signalled():
    posts = post_rounds(10, free_slots=8, signal_every=3)
    assert [(p.start, p.end) for p in posts] == [(0, 8)]  # the rest waits for completions
    assert posts[0].signalled == (2, 5, 7)  # every third, and the post's last
    posts = post_rounds(5, free_slots=64, signal_every=16)
    assert [(p.start, p.end, p.signalled) for p in posts] == [(0, 5, (4,))]
    assert post_rounds(5, free_slots=0, signal_every=4) == []
    for n, free, every in ((100, 37, 8), (7, 7, 1), (64, 64, 64)):
        for p in post_rounds(n, free, every):
            assert p.signalled[-1] == p.end - 1
            gaps = [b - a for a, b in zip((p.start - 1, *p.signalled), p.signalled)]
            assert max(gaps) <= every  # never more than signal_every requests per completion


def test_a_signalled_completion_finishes_every_job_whose_requests_it_covers():
    ledger = CompletionLedger()
    ledger.expect(0, 1)
    ledger.expect(1, 3)  # job 1's requests go out over two posts
    first = ledger.post([0, 1], signalled_at=(1,))
    assert ledger.in_flight == 2
    done, freed = ledger.complete(first[0])
    assert done == [0] and freed == 2 and ledger.in_flight == 0  # job 1 has two requests still to go
    ledger.expect(2, 1)
    a, b = ledger.post([1, 1, 2], signalled_at=(0, 2))
    assert ledger.complete(b) == ([1, 2], 3)  # b covers a too: RC completes a queue pair's requests in order
    assert ledger.remaining == {} and ledger.in_flight == 0
    with pytest.raises(RuntimeError, match="not in flight"):
        ledger.complete(a)


def test_an_error_fails_exactly_the_jobs_still_open_on_the_queue_pair():
    ledger = CompletionLedger()
    for job in (0, 1, 2):
        ledger.expect(job, 2)
    ids = ledger.post([0, 0, 1, 1, 2, 2], signalled_at=(1, 3, 5))
    assert ledger.complete(ids[0]) == ([0], 2)
    assert sorted(ledger.fail()) == [1, 2]  # job 0 was done before the error and stays done
    assert ledger.in_flight == 0 and ledger.fail() == []
    with pytest.raises(ValueError, match="end with a signalled"):
        ledger.post([3], signalled_at=())
    with pytest.raises(ValueError, match="not announced"):
        ledger.post([3], signalled_at=(0,))
