"""Multi-stage and zero-bubble schedules: exact tables, placement, registry and argument errors."""

from __future__ import annotations

import pytest

from lightning_pipe.errors import ConfigurationError, ScheduleError
from lightning_pipe.schedule import (
    ALL_SCHEDULES,
    SCHEDULES,
    forward_only,
    gpipe,
    gpipe_forward,
    grouped_deadlock,
    interleaved_1f1b,
    make_table,
    one_f_one_b,
    parse_table,
    placement,
    simulate,
    stage_ranks,
    validate,
    zb_h1,
    zb_h2,
    zbv,
)
from lightning_pipe.schedule.interleaved import microbatch_groups

# Legend: p = num_ranks, m = num_microbatches, v = virtual_stages (stages per rank),
# "4B3" = stage 4, backward of microbatch 3; I/W = input-gradient / weight-gradient backward.

# Interleaved 1F1B keeps Megatron-LM's order (Narayanan et al. 2021, section 2.2 and Figure 4,
# bottom: 4 devices, 2 chunks each, 8 microbatches). Every table here equals the one that torch's
# ScheduleInterleaved1F1B builds for the same sizes (checked when the tables were written, with
# torch.distributed.pipelining.schedules._get_1f1b_rank_ops, for p <= 6, v in {2, 3}, every m
# that torch accepts); torch refuses (2, 5, 2), where our groups are [0, 3) and [3, 5).
INTERLEAVED = {
    (4, 8, 2): [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 "
        "4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 "
        "5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7",
        "2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 "
        "6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7",
        "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 "
        "7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7",
    ],
    (2, 5, 2): [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4",
        "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4",
    ],
    (3, 3, 3): [
        "0F0 0F1 0F2 3F0 3F1 3F2 6F0 6F1 6F2 6B0 6B1 6B2 3B0 3B1 3B2 0B0 0B1 0B2",
        "1F0 1F1 1F2 4F0 4F1 4F2 7F0 7F1 7F2 7B0 7B1 7B2 4B0 4B1 4B2 1B0 1B1 1B2",
        "2F0 2F1 2F2 5F0 5F1 5F2 8F0 8B0 8F1 8B1 8F2 8B2 5B0 5B1 5B2 2B0 2B1 2B2",
    ],
    (3, 2, 2): [  # m < p: one group of 2
        "0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1",
        "1F0 1F1 4F0 4F1 4B0 4B1 1B0 1B1",
        "2F0 2F1 5F0 5B0 5F1 5B1 2B0 2B1",
    ],
}

# ZB-H1 (Qi et al. 2023, section 2.1 and Figure 3, top): 1F1B's warm-up and F/I order, rank r puts
# off its first r W to the end. Equal to torch's ScheduleInterleavedZeroBubble with one stage per
# rank (checked for p <= 8, m <= 16 when the tables were written).
ZB_H1 = {
    (4, 6): [
        "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5",
        "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5",
        "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5",
        "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5",
    ],
    (3, 2): [
        "0F0 0F1 0I0 0W0 0I1 0W1",
        "1F0 1F1 1I0 1I1 1W0 1W1",
        "2F0 2I0 2F1 2I1 2W0 2W1",
    ],
}

# ZB-V (Qi et al. 2023, section 6): for m >= 2p - 1 the tables equal what the authors' scheduler
# builds for F = I = W = 1 and free communication, the setting of the paper's ZB-V figure
# (sail-sg/zero-bubble-pipeline-parallelism, megatron/core/pipeline_parallel/zerobubble/
# scheduler/zbv.py, PipelineGraph(p, m, 1, 1, 1, 0, ...).try_v_schedule; checked for p <= 10,
# 2p - 1 <= m <= 4p + 2 when the tables were written). torch's ScheduleZBVZeroBubble has the same
# warm-up and steady phase and runs the last W of the cool-down in another order.
ZBV = {
    (4, 8): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 "
        "7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 0I4 7W7 0I5 0W4 0I6 0W5 0I7 0W6 0W7",
        "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 "
        "1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 1I4 6I7 1I5 6W6 1I6 1W4 1I7 6W7 1W5 1W6 1W7",
        "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 "
        "5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 2I4 5I6 2I5 5I7 2I6 5W5 2I7 2W4 5W6 2W5 5W7 2W6 2W7",
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 "
        "3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 4W4 3W4 4W5 3W5 4W6 3W6 4W7 3W7",
    ],
    (2, 3): [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 0I1 3W2 0I2 0W1 0W2",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 1I1 2I2 1I2 2W1 1W1 2W2 1W2",
    ],
    (3, 2): [  # m < 2p - 1: built for 5 microbatches, the actions of microbatches 2..4 dropped
        "0F0 0F1 5F0 5I0 5W0 5F1 5I1 5W1 0I0 0W0 0I1 0W1",
        "1F0 1F1 4F0 4F1 4I0 4W0 4I1 4W1 1I0 1W0 1I1 1W1",
        "2F0 3F0 2F1 3F1 3I0 3W0 2I0 2W0 3I1 3W1 2I1 2W1",
    ],
}


# ZB-H2 (Qi et al. 2023, section 2.2): ZB-H1 after 2 (p - 1 - r) warm-up forwards on rank r, each weight
# gradient 2r rounds after its input gradient (r when m < 2p - 2); written by hand from that rule.
ZB_H2 = {
    (2, 4): [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1F3 1I3 1W1 1W2 1W3",
    ],
    (3, 5): [
        "0F0 0F1 0F2 0F3 0F4 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4",
        "1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1I3 1W1 1I4 1W2 1W3 1W4",
        "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2W1 2W2 2W3 2W4",
    ],
    (3, 3): [  # m < 2p - 2: ZB-H1's put-off
        "0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2",
        "1F0 1F1 1F2 1I0 1I1 1W0 1I2 1W1 1W2",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2W1 2W2",
    ],
}


ZB_H2[(3, 4)] = [  # m = 2p - 2: already the put-off of 2r
    "0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3",
    "1F0 1F1 1F2 1I0 1F3 1I1 1I2 1W0 1I3 1W1 1W2 1W3",
    "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2W0 2W1 2W2 2W3",
]


@pytest.mark.parametrize("grid", sorted(INTERLEAVED))
def test_interleaved_1f1b_exact_tables(grid):
    assert interleaved_1f1b(*grid) == parse_table(INTERLEAVED[grid])


@pytest.mark.parametrize("grid", sorted(ZB_H1))
def test_zb_h1_exact_tables(grid):
    assert zb_h1(*grid) == parse_table(ZB_H1[grid])


@pytest.mark.parametrize("grid", sorted(ZB_H2))
def test_zb_h2_exact_tables(grid):
    assert zb_h2(*grid) == parse_table(ZB_H2[grid])


@pytest.mark.parametrize("grid", sorted(ZBV))
def test_zbv_exact_tables(grid):
    assert zbv(*grid) == parse_table(ZBV[grid])


def test_interleaved_groups_differ_by_at_most_one_larger_first():
    assert microbatch_groups(4, 8) == [range(0, 4), range(4, 8)]
    assert microbatch_groups(4, 11) == [range(0, 6), range(6, 11)]
    assert microbatch_groups(4, 14) == [range(0, 5), range(5, 10), range(10, 14)]
    assert microbatch_groups(4, 3) == [range(0, 3)]


# -- placement ------------------------------------------------------------------------------------
def test_stage_ranks_read_from_tables():
    assert stage_ranks(one_f_one_b(3, 2)) == (0, 1, 2)
    assert stage_ranks(interleaved_1f1b(3, 3, 2)) == (0, 1, 2, 0, 1, 2)
    assert stage_ranks(zbv(3, 3)) == (0, 1, 2, 2, 1, 0)


@pytest.mark.parametrize("name", sorted(ALL_SCHEDULES))
def test_spec_placement_matches_the_generated_table(name):
    spec = ALL_SCHEDULES[name]
    v = 3 if spec.stages_per_rank is None else None
    for p in (1, 2, 5):
        assert spec.stage_ranks(p, v) == stage_ranks(make_table(name, p, 6, v)), (name, p)


def test_placement_styles_and_their_errors():
    assert placement("loop", 3, 3) == (0, 1, 2)
    assert placement("v", 2, 4) == (0, 1, 1, 0)
    with pytest.raises(ConfigurationError, match=r"placement style must be one of \('loop', 'v'\), got 'ring'"):
        placement("ring", 2, 4)
    with pytest.raises(ConfigurationError, match="5 stages cannot be spread evenly over 2 ranks"):
        placement("loop", 2, 5)
    with pytest.raises(ConfigurationError, match="num_stages must be 4 for 2 ranks, got 6"):
        placement("v", 2, 6)


def test_stage_ranks_rejects_a_stage_on_two_ranks():
    with pytest.raises(ScheduleError, match="stage 0 has compute actions on rank 0 and on rank 1; a stage runs on one rank"):
        stage_ranks(parse_table(["0F0 0B0", "0F1 0B1"]))


# -- registry -------------------------------------------------------------------------------------
def test_runnable_schedules_unchanged_and_every_schedule_registered():
    assert SCHEDULES == {"gpipe": gpipe, "1f1b": one_f_one_b}
    assert sorted(ALL_SCHEDULES) == ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv"]
    assert {n: s.stages_per_rank for n, s in ALL_SCHEDULES.items()} == {
        "gpipe": 1, "1f1b": 1, "interleaved_1f1b": None, "zb_h1": 1, "zb_h2": 1, "zbv": 2}
    assert [n for n, s in ALL_SCHEDULES.items() if s.split_backward] == ["zb_h1", "zb_h2", "zbv"]
    assert [n for n, s in ALL_SCHEDULES.items() if not s.runs_on_nccl] == ["interleaved_1f1b", "zb_h2", "zbv"]
    assert all(ALL_SCHEDULES[name].generator is SCHEDULES[name] for name in SCHEDULES)


def test_runs_on_nccl_follows_the_grouped_rendezvous_model():
    """The NCCL transport issues the communication between two compute actions as one group: the schedules
    it runs never wait on each other under strict rendezvous; each refused one does at PipeStrategy's default
    m = 2p for p = 2 (ZB-H2: rank 0 groups SF3 with RB1 and posts RB2 only after it, while rank 1 sends SB2
    before it posts RF3)."""
    for name, spec in ALL_SCHEDULES.items():
        v = 2 if spec.stages_per_rank is None else None
        stuck = [(p, m) for p in range(1, 7) for m in range(1, 2 * p + 4) if grouped_deadlock(make_table(name, p, m, v))]
        assert (stuck == []) == spec.runs_on_nccl, (name, stuck)
        assert spec.runs_on_nccl or (2, 4) in stuck, (name, stuck)
    assert grouped_deadlock(make_table("zb_h2", 2, 4)) == (
        "rank 0's group 3 waits for rank 1's group 4, behind its group 3; "
        "rank 1's group 3 waits for rank 0's group 4, behind its group 3")


def test_make_table_builds_every_schedule_like_its_generator():
    assert make_table("gpipe", 3, 4) == gpipe(3, 4)
    assert make_table("1f1b", 3, 4, virtual_stages=1) == one_f_one_b(3, 4)
    assert make_table("interleaved_1f1b", 3, 4, virtual_stages=2) == interleaved_1f1b(3, 4, 2)
    assert make_table("zb_h1", 3, 4) == zb_h1(3, 4)
    assert make_table("zb_h2", 3, 4) == zb_h2(3, 4)
    assert make_table("zbv", 3, 4, virtual_stages=2) == zbv(3, 4)


@pytest.mark.parametrize(
    "args, match",
    [
        (("pipedream", 2, 4), r"unknown schedule 'pipedream': choose one of \['1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1', 'zb_h2', 'zbv'\]"),
        (("interleaved_1f1b", 2, 4), r"schedule 'interleaved_1f1b' needs virtual_stages \(stages per rank, at least 2\), e.g. virtual_stages=2"),
        (("zbv", 2, 4, 3), r"schedule 'zbv' runs exactly 2 stages per rank, got virtual_stages=3; leave virtual_stages out or pass 2"),
        (("1f1b", 2, 4, 2), r"schedule '1f1b' runs exactly 1 stage per rank, got virtual_stages=2; leave virtual_stages out or pass 1"),
        (("interleaved_1f1b", 2, 4, 1), r"interleaved_1f1b needs virtual_stages >= 2 \(stages per rank\), got 1; for one stage per rank use one_f_one_b"),
        (("interleaved_1f1b", 2, 4, 0), r"virtual_stages must be a positive integer, got 0"),
        (("interleaved_1f1b", 2, 0, 2), r"num_microbatches must be a positive integer, got 0"),
        (("zbv", 0, 4), r"num_ranks must be a positive integer, got 0"),
        (("zbv", 2, 2.0), r"num_microbatches must be a positive integer, got 2\.0"),
        (("zb_h1", True, 4), r"num_stages must be a positive integer, got True"),
        (("zb_h2", 2.0, 4), r"num_stages must be a positive integer, got 2\.0"),
        (("zb_h2", 2, 0), r"num_microbatches must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_raise_named_errors(args, match):
    with pytest.raises(ConfigurationError, match=match):
        make_table(*args)


@pytest.mark.parametrize("name", sorted(ALL_SCHEDULES))
def test_forward_only_tables_keep_the_placement_and_validate(name):
    v = 2 if ALL_SCHEDULES[name].stages_per_rank is None else None
    for p, m in [(1, 1), (2, 3), (3, 5), (4, 2)]:
        table = make_table(name, p, m, v)
        forwards = forward_only(table)
        assert stage_ranks(forwards) == stage_ranks(table), (name, p, m)
        result = simulate(validate(forwards))
        assert result.busy == (len(forwards[0]),) * p and max(result.peak_in_flight) <= len(forwards[0]), (name, p, m)
    if name in SCHEDULES:
        assert forward_only(make_table(name, 3, 4)) == gpipe_forward(3, 4)


def test_configuration_errors_are_value_errors():
    with pytest.raises(ValueError):
        interleaved_1f1b(2, 4, 1)
    with pytest.raises(ValueError):
        ALL_SCHEDULES["interleaved_1f1b"].stage_ranks(0, 2)
