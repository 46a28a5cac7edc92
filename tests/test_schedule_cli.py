"""``python -m lightning_pipe.schedule show``: the README's tables, the simulated figures, the PNG."""

from __future__ import annotations

import doctest
import re
import runpy
import sys
from pathlib import Path

import pytest

from lightning_pipe.schedule import ALL_SCHEDULES, format_table, gpipe, make_table, one_f_one_b, simulate
from lightning_pipe.schedule.action import F, I, W
from lightning_pipe.schedule.__main__ import compare, main, schedule_tables, show

README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_table(call: str) -> str:
    """The table README.md's "Schedules are data" section prints for ``print(format_table(call))``."""
    text = README.read_text()
    match = re.search(re.escape(f">>> print(format_table({call}))") + r"\n((?:rank \d+:.*\n)+)", text)
    assert match, f"README.md no longer shows format_table({call})"
    return match.group(1).rstrip("\n")


def test_readme_examples_run_as_doctests():
    """Every ``>>>`` example in README.md prints what it shows (review GGG: two printed the closing fence too)."""
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 7 and result.failed == 0, result


@pytest.mark.parametrize("argv, call", [
    ("gpipe --stages 3 --microbatches 4", "gpipe(3, 4)"),
    ("1f1b --stages 3 --microbatches 4", "one_f_one_b(3, 4)"),
    ("zb_h1 --stages 3 --microbatches 4", 'make_table("zb_h1", 3, 4)'),
    ("interleaved_1f1b --stages 2 --microbatches 4 --virtual-stages 2",
     'make_table("interleaved_1f1b", 2, 4, virtual_stages=2)'),
])
def test_show_prints_the_readme_table(argv, call, capsys):
    assert main(["show", *argv.split()]) == 0
    printed = capsys.readouterr().out
    table = _readme_table(call)
    assert printed.startswith(table + "\n\n")
    assert table == format_table(eval(call, {"gpipe": gpipe, "one_f_one_b": one_f_one_b, "make_table": make_table}))


def test_show_draws_zbv_with_its_two_stages_per_rank(capsys):
    """ZB-V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; the bubble as drawn (F = I = W)."""
    assert main(["show", "zbv", "--stages", "2", "--microbatches", "4"]) == 0
    printed = capsys.readouterr().out
    rows = printed.splitlines()[:2]
    assert {a[0] for a in rows[0].split()[2:] if a[0].isdigit()} == {"0", "3"}
    assert {a[0] for a in rows[1].split()[2:] if a[0].isdigit()} == {"1", "2"}
    assert "zbv, 2 stages, 4 microbatches" in printed


def test_show_prints_the_simulated_bubble_and_peak_activations(capsys):
    assert main(["show", "gpipe", "--stages", "3", "--microbatches", "4"]) == 0
    assert capsys.readouterr().out.endswith(
        "gpipe, 3 stages, 4 microbatches, forward 1, backward 1:\n"
        "  makespan 12, bubble 33.3%\n"
        "  peak activations per rank (microbatches through its share): 4 4 4\n"
    )
    # review T: two stages per rank count half each, as compare counts them (it printed the pairs, 5 3 and 4 4)
    assert "its share): 2.5 1.5" in show("interleaved_1f1b", 2, 4, virtual_stages=2)
    assert "its share): 2 2" in show("zbv", 2, 4)
    text = show("1f1b", 4, 8, backward_cost=2)
    assert "makespan 33, bubble 27.3%" in text and "its share): 4 3 2 1" in text


def test_show_writes_the_plan_as_png(tmp_path, capsys):
    from matplotlib.image import imread

    path = tmp_path / "plan.png"
    assert main(["show", "1f1b", "--stages", "2", "--microbatches", "3", "--png", str(path)]) == 0
    assert f"picture: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(str(path)).shape[1] > 500


@pytest.mark.parametrize("name", ["zb_h1", "zb_h2", "zbv"])
def test_the_png_of_a_split_backward_draws_i_and_w_as_show_simulates_them(tmp_path, monkeypatch, name):
    """Regression (review T): the picture of a zero-bubble schedule drew its F boxes only (I and W had no width)
    and ended at 7.5 where `show` printed makespan 13."""
    import lightning_pipe.timeline as timeline

    drawn = {}
    monkeypatch.setattr(timeline, "_draw", lambda ax, planned, measured, title, width: drawn.update(
        planned=planned, width=width))
    timeline.save_schedule_png(schedule_tables(name, 2, 4), str(tmp_path / "plan.png"))
    result = simulate(schedule_tables(name, 2, 4), 1.0, 1.0, input_cost=1.0, weight_cost=1.0)
    assert drawn["width"] == result.makespan
    assert {kind for row in drawn["planned"] for _, kind, _, d in row if d == 1.0} == {F, I, W}


def test_running_the_package_as_a_module_calls_show(monkeypatch, capsys):
    import lightning_pipe.schedule

    monkeypatch.setattr(sys, "argv", ["lightning_pipe.schedule", "show", "gpipe", "--stages", "2", "--microbatches", "2"])
    # what `python -m lightning_pipe.schedule` runs, without a new interpreter (seconds of imports)
    entry = Path(lightning_pipe.schedule.__file__).parent / "__main__.py"
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(entry), run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("rank 0: F0 F1 .. .. B1 B0\nrank 1: .. F0 F1 B1 B0 ..\n")


@pytest.mark.parametrize("argv, message", [
    (["show", "zigzag", "--stages", "2", "--microbatches", "2"], "unknown schedule 'zigzag': choose one of"),
    (["show", "1f1b", "--stages", "2", "--microbatches", "2", "--virtual-stages", "2"],
     "runs exactly 1 stage per rank, got virtual_stages=2"),
    (["show", "interleaved_1f1b", "--stages", "2", "--microbatches", "2"], "needs virtual_stages"),
    (["show", "gpipe", "--stages", "0", "--microbatches", "2"], "num_stages must be a positive integer"),
])
def test_show_reports_bad_arguments_and_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_schedule_lookup_is_one_function():
    assert schedule_tables("1f1b", 2, 3, virtual_stages=1) == one_f_one_b(2, 3)


def _compared(text: str) -> dict:
    return {row.split()[0]: [float(v.rstrip("%")) for v in row.split()[1:]] for row in text.splitlines()[2:]}


def test_compare_simulates_every_schedule_for_the_same_costs(capsys):
    assert main("compare --stages 3 --microbatches 6 --forward-cost 2 --backward-cost 4 --comm-cost 0.25".split()) == 0
    rows = _compared(capsys.readouterr().out)
    assert sorted(rows) == sorted(ALL_SCHEDULES)
    for name, (v, makespan, bubble, peak) in rows.items():
        virtual = 2 if name == "interleaved_1f1b" else None
        result = simulate(make_table(name, 3, 6, virtual), 2 / v, 4 / v, 0.25)  # a stage is 1/v of a rank's share
        assert (v, makespan, peak) == (ALL_SCHEDULES[name].virtual_stages(virtual), result.makespan,
                                       max(result.peak_memory)), name
        assert bubble == round(100 * result.bubble_fraction, 1), name


def test_compare_shows_where_zb_h2_pays_for_its_memory():
    """Free messages: ZB-V is fastest, ZB-H2 ties ZB-H1 with more activations; half an action of latency per
    message: ZB-H2 is fastest."""
    free, slow = _compared(compare(4, 16)), _compared(compare(4, 16, comm_cost=0.5))
    assert min(free, key=lambda n: free[n][1]) == "zbv"
    assert free["zb_h2"][1] == free["zb_h1"][1] and free["zb_h2"][3] == 7 > free["zb_h1"][3] == 4
    assert min(slow, key=lambda n: slow[n][1]) == "zb_h2"


def test_compare_reports_bad_arguments_and_exits_2(capsys):
    assert main("compare --stages 2 --microbatches 4 --virtual-stages 1".split()) == 2
    assert "virtual_stages >= 2" in capsys.readouterr().err


def test_the_commands_examples_run():
    """pytest's doctest collection skips a ``__main__.py``; its examples are run here."""
    import doctest

    import lightning_pipe.schedule.__main__ as module

    result = doctest.testmod(module)
    assert result.attempted >= 3 and result.failed == 0


def test_compare_prints_the_readme_table():
    text = README.read_text()
    command = "python -m lightning_pipe.schedule compare --stages 4 --microbatches 8 --comm-cost 0.5"
    match = re.search(r"\$ " + re.escape(command) + r"\n(.*?)\n```", text, re.S)
    assert match, "README.md no longer shows the compare command"
    assert match.group(1) == compare(4, 8, comm_cost=0.5)


def test_compare_gives_the_closed_forms_with_free_messages():
    """p = 3, m = 6, F = 2 and B = 4 per microbatch through a rank's share (I = W = 2; a stage of a rank
    holding two is half of it): (m + p - 1)(F + B) for GPipe and 1F1B, 3 (v m + p - 1) for interleaved,
    2 (3m + p - 1) for ZB-H1 and ZB-H2, 6m + p - 1 for ZB-V; peaks p, m, p + (p - 1) / v, p, 2p - 1, p."""
    rows = _compared(compare(3, 6, forward_cost=2, backward_cost=4))
    assert {name: (row[1], row[3]) for name, row in rows.items()} == {
        "1f1b": (48, 3), "gpipe": (48, 6), "interleaved_1f1b": (42, 4), "zb_h1": (40, 3), "zb_h2": (40, 5),
        "zbv": (38, 3)}
    assert {name: row[2] for name, row in rows.items()} == {
        "1f1b": 25.0, "gpipe": 25.0, "interleaved_1f1b": 14.3, "zb_h1": 10.0, "zb_h2": 10.0, "zbv": 5.3}
