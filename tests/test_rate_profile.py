"""Rate profiles: a trace's arrivals re-timed so its rate steps or follows a day over the run.

The trace here sends one request a second, so the re-timed arrivals' rate in any stretch of wall time is the
profile's level there, and each expected count is that level times the stretch's seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.rate_profile import RateProfile


@pytest.mark.parametrize("text", ["day:1", "day:1,2,3", "step:", "wave:1,2", "day:0,4", "step:1,-3", "step:1,x"])
def test_a_profile_that_is_not_flat_step_or_a_two_level_day_of_positive_levels_is_refused(text):
    with pytest.raises(ValueError):
        RateProfile.parse(text)


def test_profiles_parse_into_their_kind_and_levels():
    assert RateProfile.parse(None) == RateProfile.parse("flat") == RateProfile("flat", ())
    assert RateProfile.parse("step:1,3,1") == RateProfile("step", (1.0, 3.0, 1.0))
    assert RateProfile.parse("day:1,4") == RateProfile("day", (1.0, 4.0))


def test_a_profiles_mean_and_rate_at_a_time_are_its_levels():
    step, day = RateProfile.parse("step:1,3,1"), RateProfile.parse("day:1,4")
    assert step.mean == pytest.approx(5 / 3)
    assert [step.rate_at(t, 300.0) for t in (0.0, 99.0, 100.0, 199.0, 200.0, 300.0)] == [1, 1, 3, 3, 1, 1]
    assert day.mean == pytest.approx(2.5)  # (1 + 4) / 2
    # 1 + 3 (1 - cos(2 pi t / T)) / 2: 1 at night (0 and T), 4 at noon (T / 2), 2.5 at T / 4
    assert [day.rate_at(t, 400.0) for t in (0.0, 100.0, 200.0, 400.0)] == pytest.approx([1.0, 2.5, 4.0, 1.0])
    assert RateProfile().rate_at(123.0, 400.0) == 1.0


def test_flat_keeps_the_traces_own_times():
    arrivals = np.array([5.0, 5.5, 9.0, 30.0])
    retimed = RateProfile.parse("flat").retime(arrivals)
    np.testing.assert_array_equal(retimed, arrivals)
    assert retimed is not arrivals


def test_step_one_three_one_sends_three_times_the_requests_in_the_middle_third_of_the_run():
    # 900 arrivals at 0..899 s: span 899 s over the mean level 5/3 is a run of 539.4 s, thirds of 179.8 s
    # first third at 1x: trace seconds 0..179.8 -> arrivals 0..179 = 180; middle at 3x: 179.8 + 3 x 179.8 = 719.2
    # -> arrivals 180..719 = 540; last third at 1x: 720..899 = 180
    retimed = RateProfile.parse("step:1,3,1").retime(np.arange(900.0))
    assert retimed[0] == pytest.approx(0.0)
    assert retimed[-1] == pytest.approx(899 / (5 / 3))
    third = retimed[-1] / 3
    counts = np.histogram(retimed, bins=[0.0, third, 2 * third, retimed[-1] + 1])[0]
    assert counts.tolist() == [180, 540, 180]
    assert np.all(np.diff(retimed) > 0)


def test_a_day_keeps_the_order_runs_for_the_span_over_its_mean_and_peaks_at_four_times_its_start_at_noon():
    # 10,000 arrivals at 0..9999 s: the run lasts 9999 / 2.5 = 3999.6 s
    arrivals = np.arange(10_000.0)
    retimed = RateProfile.parse("day:1,4").retime(arrivals)
    assert np.all(np.diff(retimed) > 0)  # the same requests, in the same order
    assert retimed[0] == pytest.approx(0.0)
    assert retimed[-1] == pytest.approx(9999 / 2.5)
    # 80 s stretches (2% of the run): at the start the rate is about 1/s (80 arrivals), at noon about 4/s (320)
    wall = retimed[-1]
    start = np.count_nonzero(retimed < 80.0)
    noon = np.count_nonzero((retimed >= wall / 2 - 40.0) & (retimed < wall / 2 + 40.0))
    assert start == pytest.approx(80, rel=0.1)
    assert noon == pytest.approx(320, rel=0.1)
    assert noon / start == pytest.approx(4.0, rel=0.1)


def test_retime_keeps_a_trace_that_does_not_start_at_zero_starting_where_it_did():
    retimed = RateProfile.parse("step:2,2").retime(np.arange(100.0, 200.0))
    # a steady 2x: the same arrivals at half the gaps, from 100 s
    np.testing.assert_allclose(retimed, 100.0 + np.arange(100.0) / 2, atol=1e-6)


def test_a_steps_phases_split_the_retimed_run_so_each_holds_its_levels_share_of_the_requests():
    """benchmarks.replay reports a step's phases apart (admitted, refused, good per level): a phase is the span of
    wall time at one level, and the re-timed requests fall into it in proportion to that level."""
    arrivals = np.arange(0.0, 500.0)  # one a second for 500 s
    step = RateProfile.parse("step:1,4,1")
    phases = step.phases(arrivals)
    assert [level for level, _, _ in phases] == [1.0, 4.0, 1.0]
    assert phases[0][1] == 0.0 and phases[-1][2] == pytest.approx(499.0 / 2)  # the run: the span over the mean
    t = step.retime(arrivals)
    counts = [int(((t >= a) & (t < b)).sum()) for _, a, b in phases]
    assert counts[1] == pytest.approx(4 * counts[0], rel=0.05) and counts[2] == pytest.approx(counts[0], abs=2)
    assert RateProfile.parse("day:1,4").phases(arrivals) is None and RateProfile().phases(arrivals) is None
