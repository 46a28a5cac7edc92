"""Every new schedule over a grid: valid, and the simulator reproduces its bubble and its memory.

Cost model, unless a test says otherwise: ``simulate``'s defaults, ``F = 1`` and ``B = 2`` per stage
with ``I = W = 1`` when the backward is split, free communication. A stage of a rank holding ``v``
stages is ``1 / v`` of the rank's share of the model, so these costs are per stage, and the
formulas below hold in units of one stage's forward.
"""

from __future__ import annotations

import pytest

from lightning_pipe.schedule import interleaved_1f1b, lower, one_f_one_b, simulate, validate, zb_h1, zb_h2, zbv

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]


def _check(table, name):
    lowered = validate(table)
    assert lowered == lower(table), name
    result = simulate(table)
    assert simulate(lowered) == result, name
    return result


@pytest.mark.parametrize("p", range(1, 7))
def test_interleaved_1f1b_bubble_is_v_times_smaller(p):
    """Narayanan et al. 2021, section 2.2.2: bubble (p - 1) / (v m + p - 1) for m >= p."""
    for v in (2, 3, 4):
        for m in range(1, 2 * p + 3):
            result = _check(interleaved_1f1b(p, m, v), (p, m, v))
            assert result.busy == (3.0 * v * m,) * p, (p, m, v)
            # m < p: the first microbatch comes back round to rank 0 before it has other work
            assert result.makespan == 3 * (v * max(m, p) + min(m, p) - 1), (p, m, v)
            if m >= p:
                assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
            # more memory than 1F1B: rank 0 holds p + (p - 1) / v microbatches' worth at its peak
            if m >= 2 * p and m % p == 0:
                assert result.peak_memory[0] == pytest.approx(p + (p - 1) / v), (p, m, v)


def test_zb_h1_bubble_is_a_third_of_one_f_one_b_at_the_same_memory():
    """Qi et al. 2023, section 2.1 (F = I = W): 1F1B idles 3(p - 1) per rank, ZB-H1 only p - 1."""
    for p, m in GRID:
        result = _check(zb_h1(p, m), (p, m))
        baseline = simulate(one_f_one_b(p, m))
        assert result.busy == baseline.busy == (3.0 * m,) * p, (p, m)
        assert result.makespan == 3 * m + p - 1 + max(0, p - m), (p, m)
        assert baseline.makespan == 3 * (m + p - 1), (p, m)
        if m >= p:
            assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12), (p, m)
        # every rank holds as many microbatches as 1F1B's rank 0, never more
        assert result.peak_in_flight == (min(p, m),) * p, (p, m)
        assert max(result.peak_memory) == max(baseline.peak_memory), (p, m)


def test_zb_h2_has_zb_h1s_makespan_and_loses_far_less_to_message_latency():
    """Qi et al. 2023, section 2.2: ZB-H2's extra warm-up forwards hold up to 2p - 1 microbatches on every
    rank. With the step's optimizer step after every gradient its makespan is ZB-H1's; what the extra
    microbatches buy is slack: a latency c of up to one action per message costs (p - 1) c for
    m >= 2p - 1, where ZB-H1, whose ranks take turns, loses at least 4 (p - 1) c."""
    for p, m in GRID:
        result = _check(zb_h2(p, m), (p, m))
        h1 = simulate(zb_h1(p, m))
        assert result.busy == (3.0 * m,) * p, (p, m)
        assert result.makespan == h1.makespan, (p, m)
        assert max(result.peak_in_flight) == min(2 * p - 1, m), (p, m)
        for c in (0.25, 0.5, 1.0, 2.0):
            h1_time = simulate(zb_h1(p, m), comm_cost=c).makespan
            assert simulate(zb_h2(p, m), comm_cost=c).makespan <= h1_time, (p, m, c)
            if m >= 2 * p - 1 and c <= 1:
                assert simulate(zb_h2(p, m), comm_cost=c).makespan == 3 * m + p - 1 + (p - 1) * c, (p, m, c)
                assert h1_time >= 3 * m + p - 1 + 4 * (p - 1) * c, (p, m, c)
        if m >= 2 * p - 1:
            assert result.peak_in_flight == (2 * p - 1,) * p, (p, m)


def test_zbv_bubble_is_only_the_skew_at_1f1b_memory():
    """Qi et al. 2023, section 6 (F = I = W per stage, each stage half of a rank's layers): between its
    first and last action no rank idles, so the makespan is 6m plus the p - 1 skew of the V."""
    for p, m in GRID:
        result = _check(zbv(p, m), (p, m))
        assert result.busy == (6.0 * m,) * p, (p, m)
        if m >= 2 * p - 1:
            assert result.makespan == 6 * m + p - 1, (p, m)
            assert result.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12), (p, m)
        # never slower than 1F1B running whole stages (F = 2, B = 4) on the same ranks
        assert result.makespan <= simulate(one_f_one_b(p, m), 2, 4).makespan, (p, m)
        # at most 2 min(p, m) half-size (stage, microbatch) pairs held: 1F1B's peak
        assert max(result.peak_in_flight) == 2 * min(p, m), (p, m)
        assert max(result.peak_memory) == max(simulate(one_f_one_b(p, m)).peak_memory), (p, m)


def test_bubbles_rank_as_the_papers_say():
    p, m = 8, 32
    bubble = {
        "1f1b": simulate(one_f_one_b(p, m)).bubble_fraction,
        "interleaved v=2": simulate(interleaved_1f1b(p, m, 2)).bubble_fraction,
        "zb_h1": simulate(zb_h1(p, m)).bubble_fraction,
        "zbv": simulate(zbv(p, m)).bubble_fraction,
    }
    assert bubble["1f1b"] == pytest.approx(7 / 39)
    assert bubble["interleaved v=2"] == pytest.approx(7 / 71)
    assert bubble["zb_h1"] == pytest.approx(7 / 103)
    assert bubble["zbv"] == pytest.approx(7 / 199)
    assert sorted(bubble, key=bubble.get) == ["zbv", "zb_h1", "interleaved v=2", "1f1b"]


def test_zero_bubble_tables_with_communication_cost_stay_valid_and_ordered():
    """With a cost per message the V's same-rank hand-off saves one message each way per microbatch."""
    p, m, c = 4, 8, 0.5
    zbv_time = simulate(zbv(p, m), comm_cost=c).makespan
    h1_time = simulate(zb_h1(p, m), 2, 4, comm_cost=c).makespan
    assert 6 * m + p - 1 < zbv_time < h1_time
