"""A refusal for the decode side says when to come back from how fast requests were measured leaving
(conductor.drain): a client that waits that long finds the room it was refused for. With nobody measured leaving it is
half a mean decode: tests/test_conductor_admission.py (test_early_predictive_rejects_when_the_decode_batch_...)."""

from __future__ import annotations

import pytest
from conductor_helpers import cluster, conductor, request

from conductor.drain import Departures
from conductor.types import Decision, Load, Rejection, RejectReason


def test_departures_give_a_rate_over_the_window_and_none_before_enough_are_seen():
    d = Departures(window_s=60.0)
    d.left("d0", 100.0)
    d.left("d0", 104.0)
    assert d.rate(105.0) is None  # two departures say nothing about a rate
    for t in (108.0, 112.0, 116.0, 120.0):
        d.left("d0", t)
    # six departures over 20 s since the first: five in the span
    assert d.rate(120.0) == pytest.approx(5 / 20)
    assert d.retry_after(5, 120.0) == pytest.approx(20.0)
    assert d.retry_after(5, 120.0, "d1") is None  # nothing measured on d1
    d.left("d1", 110.0)
    d.left("d1", 115.0)
    d.left("d1", 120.0)
    assert d.rate(120.0, "d1") == pytest.approx(2 / 10)
    assert d.rate(120.0) == pytest.approx(5 / 20 + 2 / 10)  # the instances drain together
    # a minute with nobody leaving: the old departures no longer set the rate
    assert d.rate(200.0) is None
    d.forget("d1")
    assert d.rate(120.0, "d1") is None


def overloaded(gap_s: float, now: float = 1000.0):
    """A Conductor whose one decode instance runs 25 requests (over the TBT SLO), after 8 others left it ``gap_s``
    apart, the last just now (measured: one leaves every ``gap_s``); and its refusal of one more request."""
    c = conductor("early_predictive", default_decode_s=30.0)
    cluster(c, now=0.0)
    for n in range(8):
        c.forecast.scheduled(f"gone{n}", "d0", 0.0, 200)
        c.decode_started(f"gone{n}", 0.0)
    for n in range(8):
        c.finished(f"gone{n}", now - (7 - n) * gap_s)
    for n in range(25):
        c.forecast.scheduled(f"old{n}", "d0", now - 1.0, 200)
        c.decode_started(f"old{n}", now - 1.0)
    c.heartbeat("p0", Load(), now)
    c.heartbeat("d0", Load(running_requests=25, context_tokens=25 * 200), now)
    refused = c.schedule(request("new", blocks=10, prompt=1000), now)
    assert isinstance(refused, Rejection), refused
    assert refused.reason in (RejectReason.OVERLOAD, RejectReason.TBT_SLO)
    return c, refused


def after_departures(c, leave: int, at: float):
    """The refused request asked again at ``at``, once ``leave`` of the 25 have left."""
    for n in range(leave):
        c.finished(f"old{n}", at)
    c.heartbeat("d0", Load(running_requests=25 - leave, context_tokens=(25 - leave) * 200), at)
    c.heartbeat("p0", Load(), at)
    return c.schedule(request("new", blocks=10, prompt=1000), at)


def test_a_decode_refusal_comes_back_when_the_measured_departures_will_have_made_room():
    """The Retry-After is the time the requests that must leave take at the measured rate, to within one departure
    (the forecast's expected joins move the step by a hair): one fewer leaving and the request is still refused, one
    more and it is served."""
    now = 1000.0
    _, refused = overloaded(gap_s=2.0, now=now)
    retry = refused.retry_after_s
    assert 1.0 <= retry <= 60.0 and retry != 15.0  # not half a mean decode (t_d 30 s): measured
    leave = round(retry / 2.0)  # at the measured rate, one every 2 s
    assert 0 < leave < 25
    c, _ = overloaded(gap_s=2.0, now=now)
    assert isinstance(after_departures(c, leave - 1, now + retry), Rejection)
    c, _ = overloaded(gap_s=2.0, now=now)
    assert isinstance(after_departures(c, leave + 1, now + retry), Decision)


def test_a_slower_drain_says_come_back_later():
    _, fast = overloaded(gap_s=1.0)
    _, slow = overloaded(gap_s=3.0)
    assert fast.retry_after_s < slow.retry_after_s < 60.0
    assert slow.retry_after_s == pytest.approx(3 * fast.retry_after_s, rel=0.05)
