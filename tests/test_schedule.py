"""Schedules as data: exact tables, lowering, validation, simulation and drawing."""

from __future__ import annotations

import pytest

from lightning_pipe.errors import ConfigurationError, ScheduleError
from lightning_pipe.schedule import (
    SCHEDULES,
    Action,
    format_table,
    gpipe,
    gpipe_forward,
    lower,
    one_f_one_b,
    parse_table,
    simulate,
    validate,
)

# Legend: p = num_stages, m = num_microbatches, s = stage_index, "1F3" = stage 1, forward, microbatch 3.

GPIPE = {
    (1, 1): ["0F0 0B0"],
    (2, 2): ["0F0 0F1 0B1 0B0",
             "1F0 1F1 1B1 1B0"],
    (2, 3): ["0F0 0F1 0F2 0B2 0B1 0B0",
             "1F0 1F1 1F2 1B2 1B1 1B0"],
    (3, 2): ["0F0 0F1 0B1 0B0",
             "1F0 1F1 1B1 1B0",
             "2F0 2F1 2B1 2B0"],
    (4, 2): ["0F0 0F1 0B1 0B0",
             "1F0 1F1 1B1 1B0",
             "2F0 2F1 2B1 2B0",
             "3F0 3F1 3B1 3B0"],
    (3, 4): ["0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0",
             "1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0",
             "2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0"],
}

ONE_F_ONE_B = {
    (1, 1): ["0F0 0B0"],
    (2, 2): ["0F0 0F1 0B0 0B1",
             "1F0 1B0 1F1 1B1"],
    (2, 3): ["0F0 0F1 0B0 0F2 0B1 0B2",
             "1F0 1B0 1F1 1B1 1F2 1B2"],
    (3, 2): ["0F0 0F1 0B0 0B1",
             "1F0 1F1 1B0 1B1",
             "2F0 2B0 2F1 2B1"],
    (4, 2): ["0F0 0F1 0B0 0B1",
             "1F0 1F1 1B0 1B1",
             "2F0 2F1 2B0 2B1",
             "3F0 3B0 3F1 3B1"],
    (3, 4): ["0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
             "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
             "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"],
}

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]


# -- generators -----------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", sorted(GPIPE))
def test_gpipe_exact_tables(grid):
    assert gpipe(*grid) == parse_table(GPIPE[grid])


@pytest.mark.parametrize("grid", sorted(ONE_F_ONE_B))
def test_one_f_one_b_exact_tables(grid):
    assert one_f_one_b(*grid) == parse_table(ONE_F_ONE_B[grid])


def test_gpipe_forward_exact_table():
    assert gpipe_forward(3, 2) == parse_table(["0F0 0F1", "1F0 1F1", "2F0 2F1"])


def test_schedule_registry_names():
    assert SCHEDULES == {"gpipe": gpipe, "1f1b": one_f_one_b}


@pytest.mark.parametrize("generator", [gpipe, gpipe_forward, one_f_one_b])
@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 2), r"num_stages must be a positive integer, got 0"),
        ((2, 0), r"num_microbatches must be a positive integer, got 0"),
        ((-1, 2), r"num_stages must be a positive integer, got -1"),
        ((2, 1.0), r"num_microbatches must be a positive integer, got 1\.0"),
        ((True, 2), r"num_stages must be a positive integer, got True"),
    ],
)
def test_generators_reject_bad_grids(generator, args, match):
    with pytest.raises(ConfigurationError, match=match):
        generator(*args)


# -- lowering -------------------------------------------------------------------------------------
def test_lower_exact_one_f_one_b_2x2():
    assert lower(one_f_one_b(2, 2)) == parse_table([
        "0F0 0SF0@1 0F1 0SF1@1 0RB0@1 0B0 0RB1@1 0B1",
        "1RF0@0 1F0 1B0 1SB0@0 1RF1@0 1F1 1B1 1SB1@0",
    ])


def test_lower_exact_gpipe_3x1_middle_stage_receives_and_sends_both_ways():
    assert lower(gpipe(3, 1)) == parse_table([
        "0F0 0SF0@1 0RB0@1 0B0",
        "1RF0@0 1F0 1SF0@2 1RB0@2 1B0 1SB0@0",
        "2RF0@1 2F0 2B0 2SB0@1",
    ])


def test_lower_single_stage_adds_nothing():
    assert lower(gpipe(1, 3)) == gpipe(1, 3)


def test_lower_rejects_a_lowered_table():
    with pytest.raises(ScheduleError, match="lower\\(\\) takes a table of compute actions only; this one is lowered already"):
        lower(lower(gpipe(2, 2)))


# -- validate and simulate over the grid -----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_generated_schedule_validates_and_matches_closed_forms(name):
    generator = SCHEDULES[name]
    for p, m in GRID:
        table = generator(p, m)
        lowered = validate(table)
        assert lowered == lower(table), (name, p, m)
        result = simulate(table, forward_cost=1, backward_cost=1, comm_cost=0)
        # GPipe and (with f == b) 1F1B: makespan 2(m + p - 1), bubble (p - 1) / (m + p - 1).
        assert result.makespan == 2 * (m + p - 1), (name, p, m)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (name, p, m)
        assert result.busy == (2.0 * m,) * p, (name, p, m)
        expected_peak = (m,) * p if name == "gpipe" else tuple(min(p - s, m) for s in range(p))
        assert result.peak_in_flight == expected_peak, (name, p, m)
        assert simulate(lowered, 1, 1, 0) == result, (name, p, m)


def test_gpipe_forward_validates_over_the_grid():
    for p, m in GRID:
        result = simulate(validate(gpipe_forward(p, m)), forward_cost=1, backward_cost=1)
        assert result.makespan == m + p - 1, (p, m)
        assert result.peak_in_flight == (m,) * p, (p, m)


def test_gpipe_makespan_with_unequal_costs_and_communication():
    f, b, c = 1.0, 2.0, 0.5
    for p in range(1, 6):
        for m in range(1, 7):
            result = simulate(gpipe(p, m), forward_cost=f, backward_cost=b, comm_cost=c)
            assert result.makespan == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c), (p, m)


def test_simulate_exact_start_times():
    assert simulate(gpipe(2, 2), 1, 1).start_times == ((0.0, 1.0, 4.0, 5.0), (1.0, 2.0, 3.0, 4.0))
    assert simulate(one_f_one_b(2, 3), 1, 1).start_times == (
        (0.0, 1.0, 3.0, 4.0, 5.0, 7.0),
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0),
    )


def test_simulate_default_costs_backward_twice_forward():
    result = simulate(gpipe(2, 4))
    assert result.makespan == 3 * (4 + 2 - 1)
    assert result.busy == (12.0, 12.0)


def test_validate_returns_a_lowered_table_unchanged():
    table = parse_table(["0F0 0SF0@1 0RB0@1 0B0", "1RF0@0 1F0 1B0 1SB0@0"])
    assert validate(table) is table


# -- validate rejects bad tables --------------------------------------------------------------------
BAD_TABLES = {
    "backward before forward": (
        ["0B0 0F0"],
        "invalid schedule:\n"
        "- rank 0, action 0: 0B0 runs before its forward\n"
        "rank 0: 0B0 <-- ERROR HERE 0F0",
    ),
    "duplicate action": (
        ["0F0 0F0 0B0"],
        "invalid schedule:\n"
        "- rank 0, action 1: 0F0 appears twice\n"
        "rank 0: 0F0 0F0 <-- ERROR HERE 0B0",
    ),
    "stage on two ranks": (
        ["0F0 0B0", "0F1 0B1"],
        "invalid schedule:\n"
        "- rank 1, action 0: stage 0 runs on rank 0 and on rank 1\n"
        "- rank 1, action 1: stage 0 runs on rank 0 and on rank 1\n"
        "rank 0: 0F0 0B0\n"
        "rank 1: 0F1 <-- ERROR HERE 0B1",
    ),
    "receive without send": (
        ["0F0 0SF0@1 0RB0@1 0B0", "1RF0@0 1F0 1B0"],
        "invalid schedule:\n"
        "- rank 0, action 2: no matching send\n"
        "rank 0: 0F0 0SF0@1 0RB0@1 <-- ERROR HERE 0B0\n"
        "rank 1: 1RF0@0 1F0 1B0",
    ),
    "out-of-order link": (
        ["0F0 0SF0@1 0F1 0SF1@1 0RB0@1 0B0 0RB1@1 0B1",
         "1RF1@0 1F1 1RF0@0 1F0 1B0 1SB0@0 1B1 1SB1@0"],
        "invalid schedule:\n"
        "- rank 1, action 0: receives out of order: message 0 on this link is stage 0 -> 1, microbatch 0\n"
        "rank 0: 0F0 0SF0@1 0F1 0SF1@1 0RB0@1 0B0 0RB1@1 0B1\n"
        "rank 1: 1RF1@0 <-- ERROR HERE 1F1 1RF0@0 1F0 1B0 1SB0@0 1B1 1SB1@0",
    ),
    "compute before its receive": (
        ["0F0 0SF0@1 0RB0@1 0B0", "1F0 1RF0@0 1B0 1SB0@0"],
        "invalid schedule:\n"
        "- rank 1, action 1: 1RF0@0 receives the input of 1F0 after it ran\n"
        "rank 0: 0F0 0SF0@1 0RB0@1 0B0\n"
        "rank 1: 1F0 1RF0@0 <-- ERROR HERE 1B0 1SB0@0",
    ),
    "compute without its receive": (
        ["0F0 0SF0@1 0RB0@1 0B0", "1F0 1B0 1SB0@0"],
        "invalid schedule:\n"
        "- rank 1, action 0: 1F0 runs without receiving its input\n"
        "- rank 0, action 1: no matching receive\n"
        "rank 0: 0F0 0SF0@1 <-- ERROR HERE 0RB0@1 0B0\n"
        "rank 1: 1F0 <-- ERROR HERE 1B0 1SB0@0",
    ),
    "send before compute": (
        ["0SF0@1 0F0 0RB0@1 0B0", "1RF0@0 1F0 1B0 1SB0@0"],
        "invalid schedule:\n"
        "- rank 0, action 0: 0SF0@1 sends before 0F0 ran\n"
        "rank 0: 0SF0@1 <-- ERROR HERE 0F0 0RB0@1 0B0\n"
        "rank 1: 1RF0@0 1F0 1B0 1SB0@0",
    ),
    "peer that no rank runs": (
        ["0F0 0SF0@5 0B0"],
        "invalid schedule:\n"
        "- rank 0, action 1: 0SF0@5 names stage 5, which no rank runs\n"
        "rank 0: 0F0 0SF0@5 <-- ERROR HERE 0B0",
    ),
    # Links are matched in order, yet each rank blocks on a receive whose send the other rank only
    # issues after its own blocked receive: only the simulation can find this.
    "deadlock": (
        ["0F0 0SF0@1 0RB0@1 0B0 0F1 0SF1@1 0RB1@1 0B1",
         "1RF0@0 1F0 1RF1@0 1F1 1B0 1SB0@0 1B1 1SB1@0"],
        "the schedule deadlocks: these receives wait for sends that never come first\n"
        "rank 0: 0F0 0SF0@1 0RB0@1 <-- ERROR HERE 0B0 0F1 0SF1@1 0RB1@1 0B1\n"
        "rank 1: 1RF0@0 1F0 1RF1@0 <-- ERROR HERE 1F1 1B0 1SB0@0 1B1 1SB1@0",
    ),
    "deadlock, receive first": (
        ["0RB0@1 0F0 0SF0@1 0B0", "1RF0@0 1F0 1B0 1SB0@0"],
        "the schedule deadlocks: these receives wait for sends that never come first\n"
        "rank 0: 0RB0@1 <-- ERROR HERE 0F0 0SF0@1 0B0\n"
        "rank 1: 1RF0@0 <-- ERROR HERE 1F0 1B0 1SB0@0",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_validate_rejects_bad_tables_pointing_at_the_action(case):
    rows, message = BAD_TABLES[case]
    with pytest.raises(ScheduleError) as info:
        validate(parse_table(rows))
    assert str(info.value) == message
    assert "<-- ERROR HERE" in str(info.value)


@pytest.mark.parametrize(
    "rows, missing",
    [
        (["0F0 0F1 0B0"], "0B1"),
        (["0F0 0F1 0B1 0B0", "1F0 1B0 1F1"], "1B1"),
        (["0F0 0F1 0B1 0B0", "1F0 1B0"], "1F1 is missing\n- 1B1"),
    ],
)
def test_validate_rejects_missing_action(rows, missing):
    with pytest.raises(ScheduleError, match=f"invalid schedule:\n- {missing} is missing\nrank 0: "):
        validate(parse_table(rows))


def test_validate_marks_the_row_of_a_missing_action():
    with pytest.raises(ScheduleError, match="<-- ERROR HERE"):
        validate(parse_table(["0F0 0F1 0B1 0B0", "1F0 1B0 1F1"]))


def test_validate_rejects_gaps_in_stages_or_microbatches():
    with pytest.raises(ScheduleError, match=r"stages \[0\] and microbatches \[1\] must count from 0 without gaps"):
        validate(parse_table(["0F1 0B1"]))


def test_validate_lists_several_problems_at_once():
    with pytest.raises(ScheduleError) as info:
        validate(parse_table(["0B0 0F0 0F0"]))
    message = str(info.value)
    assert "- rank 0, action 0: 0B0 runs before its forward" in message
    assert "- rank 0, action 2: 0F0 appears twice" in message


def test_schedule_error_is_a_value_error():
    with pytest.raises(ValueError, match="runs before its forward"):
        validate(parse_table(["0B0 0F0"]))


def test_simulate_names_the_deadlock():
    rows, message = BAD_TABLES["deadlock"]
    with pytest.raises(ScheduleError) as info:
        simulate(parse_table(rows))
    assert str(info.value) == message


# -- the action IR --------------------------------------------------------------------------------
def test_action_text_form():
    assert str(Action("F", 1, 3)) == "1F3"
    assert repr(Action("SF", 0, 2, 1)) == "0SF2@1"
    action = Action.parse("0SF2@1")
    assert (action.kind, action.stage_index, action.microbatch_index, action.peer) == ("SF", 0, 2, 1)
    assert action.is_send and not action.is_recv and not action.is_compute
    assert Action.parse("  12B34 ") == Action("B", 12, 34)
    assert Action.parse("3RB7@4").is_recv
    assert parse_table(["0F0 0B0", "1F0   1B0"]) == ((Action("F", 0, 0), Action("B", 0, 0)),
                                                  (Action("F", 1, 0), Action("B", 1, 0)))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_action_parse_round_trips_every_lowered_action(name):
    for p, m in [(1, 1), (3, 4), (5, 2)]:
        for row in lower(SCHEDULES[name](p, m)):
            for action in row:
                assert Action.parse(str(action)) == action
                assert type(Action.parse(str(action)).peer) is type(action.peer)


@pytest.mark.parametrize("text", ["", "F0", "1X0", "1F", "1F0@", "1 F 0", "-1F0", "1F0@x", "1f0", "1SF", "1F0 1B0", "F"])
def test_action_parse_rejects_garbage(text):
    with pytest.raises(ValueError, match=r"cannot parse action .*: expected '<stage><kind><microbatch>\[@<peer>\]'"):
        Action.parse(text)


def test_parse_table_rejects_garbage_in_a_row():
    with pytest.raises(ValueError, match="cannot parse action '0Q1'"):
        parse_table(["0F0 0Q1"])


# -- drawing --------------------------------------------------------------------------------------
def test_format_table_gpipe_3x2():
    assert format_table(gpipe(3, 2)) == (
        "rank 0: F0 F1 .. .. .. .. B1 B0\n"
        "rank 1: .. F0 F1 .. .. B1 B0 ..\n"
        "rank 2: .. .. F0 F1 B1 B0 .. .."
    )


def test_format_table_one_f_one_b_3x4():
    assert format_table(one_f_one_b(3, 4)) == (
        "rank 0: F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3\n"
        "rank 1: .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..\n"
        "rank 2: .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. .."
    )


def test_format_table_backward_twice_forward_spans_two_slots():
    assert format_table(gpipe(2, 2), forward_cost=1, backward_cost=2) == (
        "rank 0: F0 F1 .. .. .. B1 B1 B0 B0\n"
        "rank 1: .. F0 F1 B1 B1 B0 B0 .. .."
    )


def test_format_table_accepts_lowered_tables():
    assert format_table(lower(one_f_one_b(2, 3))) == format_table(one_f_one_b(2, 3))


def test_validate_finds_out_of_order_links_in_compute_tables():
    """Stage 1 takes microbatch 1 first although stage 0 sends microbatch 0 first: gloo would hand it
    the wrong tensors (messages on a link are matched in FIFO order)."""
    with pytest.raises(ScheduleError, match=r"rank 1, action 0: receives out of order: the next message on "
                                            r"this link is microbatch 0\nrank 0: .*\nrank 1: 1RF1@0 <-- ERROR HERE"):
        validate(parse_table(["0F0 0F1 0B1 0B0", "1F1 1F0 1B1 1B0"]))
