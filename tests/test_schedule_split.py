"""Split backward (I, W) and several stages per rank: lowering, validation, simulation, drawing."""

from __future__ import annotations

import pytest

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule import (
    Action,
    format_table,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    parse_table,
    simulate,
    validate,
    zb_h1,
    zbv,
)

# Legend: "2I5" = stage 2, input-gradient backward of microbatch 5; "2W5" its weight gradient.


def test_split_backward_kinds_parse_and_print():
    assert Action.parse("2I5") == Action("I", 2, 5)
    assert str(Action("W", 0, 1)) == "0W1"
    assert Action.parse("0I0").is_compute and Action.parse("0W0").is_compute
    assert not Action.parse("0W0").is_send and not Action.parse("0I0").is_recv


# -- lowering -------------------------------------------------------------------------------------
def test_lower_split_backward_gradients_around_i_nothing_around_w():
    assert lower(zb_h1(2, 2)) == parse_table([
        "0F0 0SF0@1 0F1 0SF1@1 0RB0@1 0I0 0W0 0RB1@1 0I1 0W1",
        "1RF0@0 1F0 1I0 1SB0@0 1RF1@0 1F1 1I1 1SB1@0 1W0 1W1",
    ])


def test_lower_zbv_hands_off_locally_between_the_middle_stages():
    """Stages 1 and 2 both run on rank 1: 2F0 takes 1F0's output and 1I0 takes 2I0's gradient there."""
    assert lower(zbv(2, 1)) == parse_table([
        "0F0 0SF0@1 3RF0@2 3F0 3I0 3SB0@2 3W0 0RB0@1 0I0 0W0",
        "1RF0@0 1F0 2F0 2SF0@3 2RB0@3 2I0 2W0 1I0 1SB0@0 1W0",
    ])


def test_lower_single_rank_with_two_stages_adds_nothing():
    assert lower(zbv(1, 2)) == zbv(1, 2)
    assert lower(interleaved_1f1b(1, 2, 3)) == interleaved_1f1b(1, 2, 3)


def test_lower_interleaved_wraps_from_the_last_rank_to_the_first():
    assert lower(interleaved_1f1b(2, 1, 2)) == parse_table([
        "0F0 0SF0@1 2RF0@1 2F0 2SF0@3 2RB0@3 2B0 2SB0@1 0RB0@1 0B0",
        "1RF0@0 1F0 1SF0@2 3RF0@2 3F0 3B0 3SB0@2 1RB0@2 1B0 1SB0@0",
    ])


def test_lower_skip_routes_cross_ranks_only():
    # (1, 2) stays on rank 1: no message; (0, 2) crosses from rank 0 to rank 1, its gradient after 2I0.
    assert lower(zbv(2, 1), [(1, 2), (0, 2)]) == parse_table([
        "0F0 0SF0@1 0SS0@2 3RF0@2 3F0 3I0 3SB0@2 3W0 0RB0@1 0RG0@2 0I0 0W0",
        "1RF0@0 1F0 2RS0@0 2F0 2SF0@3 2RB0@3 2I0 2SG0@0 2W0 1I0 1SB0@0 1W0",
    ])


def test_lower_rejects_a_route_to_a_stage_no_rank_runs():
    with pytest.raises(ScheduleError, match=r"skip route \(0, 4\) names a stage that no rank runs \(stages 0..3\)"):
        lower(zbv(2, 1), [(0, 4)])


# -- validation -----------------------------------------------------------------------------------
def test_validate_accepts_b_for_some_microbatches_and_i_w_for_others():
    assert validate(parse_table(["0F0 0F1 0I0 0B1 0W0"])) == parse_table(["0F0 0F1 0I0 0B1 0W0"])


def test_validate_accepts_its_own_lowering_of_multi_stage_tables():
    for table in (zbv(3, 4), interleaved_1f1b(3, 4, 2), zb_h1(3, 4)):
        lowered = lower(table)
        assert validate(lowered) is lowered


BAD_SPLIT_TABLES = {
    "weight before input gradient": (
        ["0F0 0W0 0I0"],
        "- rank 0, action 1: 0W0 runs before its input gradient 0I0\n"
        "rank 0: 0F0 0W0 <-- ERROR HERE 0I0",
    ),
    "input gradient before forward": (
        ["0I0 0F0 0W0"],
        "- rank 0, action 0: 0I0 runs before its forward\n"
        "rank 0: 0I0 <-- ERROR HERE 0F0 0W0",
    ),
    "both B and I": (
        ["0F0 0I0 0B0 0W0"],
        "- rank 0, action 2: 0B0 and 0I0 both appear: a backward is either one B, or one I and one W\n"
        "rank 0: 0F0 0I0 0B0 <-- ERROR HERE 0W0",
    ),
    "weight gradient missing": (
        ["0F0 0I0"],
        "- 0W0 is missing\n"
        "rank 0: 0F0 0I0 <-- ERROR HERE",
    ),
    "a microbatch's split backward missing": (
        ["0F0 0F1 0I0 0W0"],
        "- 0I1 is missing\n"
        "- 0W1 is missing\n"
        "rank 0: 0F0 0F1 0I0 0W0 <-- ERROR HERE",
    ),
    "forward before its same-rank input": (
        ["1F0 0F0 1I0 0I0 1W0 0W0"],
        "- rank 0, action 0: 1F0 runs before 0F0, whose output it takes on the same rank\n"
        "rank 0: 1F0 <-- ERROR HERE 0F0 1I0 0I0 1W0 0W0",
    ),
    "backward before its same-rank gradient": (
        ["0F0 1F0 0I0 1I0 0W0 1W0"],
        "- rank 0, action 2: 0I0 runs before 1I0, whose input gradient it takes on the same rank\n"
        "rank 0: 0F0 1F0 0I0 <-- ERROR HERE 1I0 0W0 1W0",
    ),
    "message between stages on one rank": (
        ["0F0 0SF0@1 1F0 1B0 0B0"],
        "- rank 0, action 1: 0SF0@1 names stage 1 on the same rank: a same-rank hand-off has no message\n"
        "rank 0: 0F0 0SF0@1 <-- ERROR HERE 1F0 1B0 0B0",
    ),
    "split backward without its receive": (
        ["0F0 0SF0@1 0I0 0W0", "1RF0@0 1F0 1I0 1SB0@0 1W0"],
        "- rank 0, action 2: 0I0 runs without receiving its input\n"
        "- rank 1, action 3: no matching receive\n"
        "rank 0: 0F0 0SF0@1 0I0 <-- ERROR HERE 0W0\n"
        "rank 1: 1RF0@0 1F0 1I0 1SB0@0 <-- ERROR HERE 1W0",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPLIT_TABLES))
def test_validate_rejects_bad_split_and_same_rank_tables(case):
    rows, message = BAD_SPLIT_TABLES[case]
    with pytest.raises(ScheduleError) as info:
        validate(parse_table(rows))
    assert str(info.value) == "invalid schedule:\n" + message


def test_validate_keeps_one_fifo_per_rank_pair_across_stages():
    """Rank 0 sends stage 0 -> 1 of microbatch 1 before stage 2 -> 3 of microbatch 0 on the same link
    (activations, rank 0 -> rank 1); rank 1 wants the latter first. A transport with one tag per kind
    of message would hand it the wrong tensors."""
    with pytest.raises(ScheduleError, match=r"rank 1, action 3: receives out of order: the next message on this link "
                                            r"is stage 0 -> 1, microbatch 1\n"):
        validate(parse_table(["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1", "1F0 3F0 3B0 1F1 3F1 3B1 1B0 1B1"]))


# -- simulation -----------------------------------------------------------------------------------
def test_simulate_splits_backward_cost_evenly_by_default():
    result = simulate(zb_h1(1, 2))
    assert result.busy == (2 * (1 + 1 + 1),)
    assert result.start_times == ((0.0, 1.0, 2.0, 3.0, 4.0, 5.0),)


def test_simulate_takes_input_and_weight_costs():
    result = simulate(zb_h1(1, 2), 1, 2, input_cost=0.5, weight_cost=1.5)
    assert result.busy == (6.0,)
    assert result.start_times == ((0.0, 1.0, 1.5, 3.0, 4.0, 4.5),)  # F0 I0 W0 F1 I1 W1


def test_peak_in_flight_counts_until_the_weight_gradient():
    assert simulate(parse_table(["0F0 0B0 0F1 0B1"])).peak_in_flight == (1,)
    assert simulate(parse_table(["0F0 0I0 0F1 0I1 0W0 0W1"])).peak_in_flight == (2,)
    assert simulate(parse_table(["0F0 0I0 0W0 0F1 0I1 0W1"])).peak_in_flight == (1,)


def test_peak_memory_weighs_each_stage_by_the_stages_on_its_rank():
    result = simulate(zbv(2, 6))
    assert result.peak_in_flight == (4, 4)
    assert result.peak_memory == (2.0, 2.0)
    assert simulate(one_f_one_b(2, 6)).peak_memory == (2.0, 1.0)


# -- drawing --------------------------------------------------------------------------------------
def test_format_table_zb_h1_one_slot_per_action():
    assert format_table(zb_h1(3, 4)) == (
        "rank 0: F0 F1 F2 .. .. I0 W0 F3 I1 W1 I2 W2 I3 W3\n"
        "rank 1: .. F0 F1 .. I0 F2 I1 W0 F3 I2 W1 I3 W2 W3\n"
        "rank 2: .. .. F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"
    )


def test_format_table_names_stages_when_a_rank_holds_several():
    assert format_table(interleaved_1f1b(2, 4, 2)) == (
        "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 ... 2B2 ... 2B3 0B2 0B3\n"
        "rank 1: ... 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 ..."
    )
    assert format_table(zbv(2, 3)) == (
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 0I1 3W2 0I2 0W1 0W2 ...\n"
        "rank 1: ... 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 1I1 2I2 1I2 2W1 1W1 2W2 1W2"
    )


def test_format_table_weight_gradients_spanning_two_slots():
    assert format_table(zb_h1(2, 2), 1, 1, input_cost=1, weight_cost=2) == (
        "rank 0: F0 F1 .. I0 W0 W0 I1 W1 W1\n"
        "rank 1: .. F0 I0 F1 I1 W0 W0 W1 W1"
    )
