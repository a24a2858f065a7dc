"""Transfer engine (DESIGN §6): registered segments, one-sided read/write; shm, tcp, rdma.

Not built yet (issue 3).
"""
