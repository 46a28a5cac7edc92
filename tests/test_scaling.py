"""PipeStrategy at scale: pp x dp, pure dp, two nodes, and failures that must not hang.

Every run is a script in a subprocess of its own session (Lightning's launcher or torchrun starts
the other ranks inside it), with a hard timeout after which the whole process group is killed.
Ports are chosen by Lightning, or found free at run time for torchrun. The expensive runs are
module-scoped fixtures shared by several tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import stop_reasons
from tests.test_strategy import assert_same_run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APP = os.path.join(HERE, "lightning_app.py")
FAULT_APP = os.path.join(HERE, "fault_app.py")
TIMEOUT = 240
HANG_BOUND_S = 120.0  # a failed run, all of its processes included, must be gone within this


# -- running scripts ----------------------------------------------------------------------------
def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "PL_", "LOCAL_RANK", "NODE_RANK"))}
    # PYTHONFAULTHANDLER: a process still running when its launch is killed prints every thread's stack first
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)
    return env


def _live_members(pgid: int) -> list:
    """Pids of the processes of group ``pgid`` that still run (zombies left to an absent reaper excluded)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            alive.append(int(entry))
    return alive


def _describe(pid: int) -> str:
    """``"pid (LOCAL_RANK=1, NODE_RANK=0)"``: which rank a surviving process is."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return str(pid)
    ranks = ", ".join(f"{k}={env[k.encode()].decode()}" for k in ("LOCAL_RANK", "NODE_RANK") if k.encode() in env)
    return f"{pid} ({ranks})"


def _wait_for_group(pgid: int, deadline: float) -> list:
    """Wait until no process of the group is left or the deadline passes; return the survivors."""
    while True:
        alive = _live_members(pgid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _no_core_files() -> None:
    """In a launched script, before it starts: a SIGABRT (see Launch.kill) writes no core file."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Launch:
    """Scripts started together, each in its own session, output to a file; killed as groups on exit.
    ``env`` is every script's environment, or a list of one per script."""

    def __init__(self, root, commands, env):
        self.root = root
        self.start = time.monotonic()
        self.logs = [open(root / f"output{i}.txt", "w+") for i in range(len(commands))]
        envs = env if isinstance(env, list) else [env] * len(commands)
        self.procs = [
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env_, cwd=ROOT, start_new_session=True,
                             preexec_fn=_no_core_files)
            for cmd, log, env_ in zip(commands, self.logs, envs)
        ]

    def finish(self, timeout: float):
        """Wait for every script and every process it started.

        Returns:
            ``(return codes, seconds until the last process was gone, survivors, outputs)``.
        """
        deadline = self.start + timeout
        try:
            codes = []
            for proc in self.procs:
                try:
                    codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
                except subprocess.TimeoutExpired:
                    codes.append(None)
            survivors = [_describe(pid) for proc in self.procs for pid in _wait_for_group(proc.pid, deadline)]
            seconds = time.monotonic() - self.start
        finally:
            self.kill()
        outputs = []
        for log in self.logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        return codes, seconds, survivors, outputs

    def kill(self):
        hung = [proc.pid for proc in self.procs if _live_members(proc.pid)]
        for pgid in hung:  # a hang: faulthandler writes each thread's stack to the output on SIGABRT (see _env)
            try:
                os.killpg(pgid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while any(_live_members(pgid) for pgid in hung) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _run(tmp_path_factory, name, script, *args, env=None, timeout=TIMEOUT):
    """Run ``script`` to success and return what rank 0 saved, plus ``root`` and ``output``."""
    root = tmp_path_factory.mktemp(name)
    out = root / "result.pt"
    cmd = [sys.executable, script, "--root", str(root), "--out", str(out), *map(str, args)]
    codes, seconds, survivors, (output,) = Launch(root, [cmd], env or _env()).finish(timeout)
    assert codes == [0] and not survivors, f"{' '.join(cmd)} -> {codes}, survivors {survivors}:\n{output[-6000:]}"
    result = torch.load(out, weights_only=False)
    result.update(root=root, output=output, seconds=seconds)
    return result


def _fail(tmp_path_factory, name, *args, timeout=HANG_BOUND_S + 60):
    """Run tests/fault_app.py, which must fail; return ``(return code, seconds, survivors, output, root)``."""
    root = tmp_path_factory.mktemp(name)
    cmd = [sys.executable, FAULT_APP, "--root", str(root), "--out", str(root / "result.pt"), *map(str, args)]
    (code,), seconds, survivors, (output,) = Launch(root, [cmd], _env(FAULT_STAMP=str(root / "failed_at"))).finish(timeout)
    assert not (root / "result.pt").exists(), "the run finished although a rank failed"
    return code, seconds, survivors, output, root


def _seconds_after_the_failure(root, seconds):
    """How long the processes outlived the injected failure (``seconds``: from the launch until they were gone)."""
    failed_at = float((root / "failed_at").read_text())
    launched_at = time.time() - seconds  # close enough: Launch.finish returned just now
    return seconds - (failed_at - launched_at)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_same_weights(result, expected):
    assert result["state_dict"].keys() == expected["state_dict"].keys()
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(result["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
    assert result["global_step"] == expected["global_step"]


# -- reference and shared runs ----------------------------------------------------------------
@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Lightning's DDP on two devices (the run a pipeline replicated twice must reproduce) and pipe_size=1."""
    root = tmp_path_factory.mktemp("two_processes")
    runs = {"ddp2": ["--strategy", "ddp", "--devices", 2],
            "pipe1x2": ["--strategy", "pipe", "--devices", 2, "--pipe-size", 1],
            "ddp2_bn": ["--strategy", "ddp", "--devices", 2, "--model", "skipbn"]}
    cmd = [sys.executable, APP, "--runs", json.dumps(runs), "--root", str(root)]
    codes, seconds, survivors, (output,) = Launch(root, [cmd], _env()).finish(TIMEOUT * 2)
    assert codes == [0] and not survivors, f"{codes}, survivors {survivors}:\n{output[-6000:]}"
    return {name: dict(torch.load(root / name / "result.pt", weights_only=False), output=output, root=root / name)
            for name in runs}


@pytest.fixture(scope="module")
def ddp2(two_processes):
    return two_processes["ddp2"]


@pytest.fixture(scope="module")
def pipe2x2(tmp_path_factory):
    """2 stages x 2 replicas on 4 processes, the single-node run of the multi-node and resume tests."""
    result = _run(tmp_path_factory, "pipe2x2", APP, "--strategy", "pipe", "--devices", 4, "--pipe-size", 2)
    assert "PipeStrategy: 2 stages x 2 replicas" in result["output"]
    return result


# -- 1, 2: data parallelism composed with the pipeline ------------------------------------------
def test_two_stages_times_two_replicas_equals_ddp(pipe2x2, ddp2):
    """Weights, callback metrics, CSV logs, validation, predictions and global_step of pp=2 x dp=2 equal DDP(2)."""
    assert_same_run(pipe2x2, ddp2)


def test_replicas_evaluate_with_replica_zeros_batch_norm_statistics_as_under_ddp(tmp_path_factory, two_processes):
    """Regression (review MM): each replica kept its own BatchNorm running statistics, where DDP's forward starts from
    rank 0's buffers after a synced step (broadcast_buffers), so replica 1 validated with other statistics and the
    val_loss logged during fit (averaged over replicas) differed from DDP's (0.511131 against 0.511596)."""
    result = _run(tmp_path_factory, "pipe2x2_bn", APP, "--strategy", "pipe", "--devices", 4, "--pipe-size", 2,
                  "--model", "skipbn", "--microbatches", 1)
    assert_same_run(result, two_processes["ddp2_bn"])


def test_process_groups_are_destroyed_before_the_interpreter_exits(pipe2x2):
    """A gloo group left to finalization aborted a finished run now and then (SIGABRT after fit:
    "terminate called without an active exception"); the strategy destroys the groups at exit."""
    assert (pipe2x2["root"] / "exit_rank0.txt").read_text() == "False"


def test_pipe_size_one_is_data_parallel_ddp(two_processes, ddp2):
    """pipe_size=1: every process holds the whole body; the run is plain data parallelism."""
    result = two_processes["pipe1x2"]
    assert "PipeStrategy: 1 stages x 2 replicas" in result["output"]
    assert_same_run(result, ddp2)


# -- 3: tied weights: tests/test_model_styles.py (embeddings tied across stages, blocks shared by every
# stage, a tie inside an nn.Sequential body; Adam, global-norm clipping, checkpoints holding one copy)


# -- 4: two nodes on loopback --------------------------------------------------------------------
def test_two_nodes_of_two_processes_equal_one_node_of_four(tmp_path_factory, pipe2x2):
    """torchrun --nnodes 2: Lightning's TorchElasticEnvironment; stage 0 on node 0, stage 1 on node 1."""
    root = tmp_path_factory.mktemp("two_nodes")
    out = root / "result.pt"
    port = _free_port()
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
         APP, "--strategy", "pipe", "--devices", 2, "--pipe-size", 2, "--root", root, "--out", out]
        for node in (0, 1)
    ]
    # lightning_app.py has no --num-nodes; Trainer reads defaults for unset arguments from PL_TRAINER_*.
    env = _env(PL_TRAINER_NUM_NODES="2")
    codes, _, survivors, outputs = Launch(root, [list(map(str, c)) for c in commands], env).finish(TIMEOUT)
    assert codes == [0, 0] and not survivors, f"{codes}, survivors {survivors}:\n" + "\n".join(o[-4000:] for o in outputs)
    assert "PipeStrategy: 2 stages x 2 replicas" in outputs[0]
    assert "GLOBAL_RANK: 2, MEMBER: 3/4" in outputs[1] and "GLOBAL_RANK: 3, MEMBER: 4/4" in outputs[1]
    result = dict(torch.load(out, weights_only=False), root=root)  # both nodes write there (one machine)
    assert_same_run(result, pipe2x2)


# -- 5: failures end the whole run, quickly -------------------------------------------------------
@pytest.fixture(scope="module")
def failed_in_second_epoch(tmp_path_factory):
    """pp=2 x dp=2; global rank 3 (stage 1 of replica 1) raises in training_step of epoch 1, batch 1."""
    return _fail(
        tmp_path_factory, "raise_rank3", "--fail-rank", 3, "--fail-epoch", 1, "--fail-batch", 1,
        "--strategy", "pipe", "--devices", 4, "--pipe-size", 2,
    )


def test_an_error_on_one_rank_ends_every_process(failed_in_second_epoch):
    code, seconds, survivors, output, _ = failed_in_second_epoch
    assert code != 0
    assert not survivors and seconds < HANG_BOUND_S, (seconds, survivors, output[-4000:])
    reasons = stop_reasons(output)
    # the stage that failed says where; its pipeline peer (stage 0 of replica 1) is told why it stops
    assert reasons[3].startswith("PipelineStepError: [pp_rank 1 | step"), reasons
    assert reasons[3].endswith("RuntimeError: injected failure on global rank 3"), reasons
    assert "because another rank failed: [pp_rank 1 | step" in reasons[1], reasons


def test_ranks_stopped_by_an_error_exit_with_it_not_an_abort(tmp_path_factory):
    """Regression (reviews UU, WW): after rank 1 raised in its step, a rank's receive thread, blocked on the other's
    message, returned as that process exited and its connection closed; where this interpreter was finalizing by
    then, the process aborted ("terminate called without an active exception", exit status 134 in 2 of 3 runs, the
    message in 3 of 3). Now the lower rank lets such threads end before it finalizes, and the higher one exits first."""
    code, seconds, survivors, output, _ = _fail(
        tmp_path_factory, "raise_rank1", "--fail-rank", 1, "--fail-epoch", 0, "--fail-batch", 1,
        "--strategy", "pipe", "--devices", 2,
    )
    assert code == 1 and "terminate called" not in output and not survivors, (code, survivors, output[-4000:])
    assert stop_reasons(output)[1].endswith("RuntimeError: injected failure on global rank 1")


@pytest.mark.parametrize("rank", [0, 1], ids=["first_stage_main_process", "last_stage_child"])
def test_a_killed_rank_ends_every_process(tmp_path_factory, rank):
    """SIGKILL on a rank mid-epoch: no rank is left waiting, whether the dead one launched the others or not."""
    code, seconds, survivors, output, _ = _fail(
        tmp_path_factory, f"kill_rank{rank}", "--fail-rank", rank, "--fail-epoch", 0, "--fail-batch", 2,
        "--fail-how", "kill", "--strategy", "pipe", "--devices", 2,
    )
    assert code != 0
    assert not survivors and seconds < HANG_BOUND_S, (seconds, survivors, output[-4000:])


# A failure in replica 0 during a batch that only accumulates (batch 2: no gradient all-reduce) leaves
# replica 1 (ranks 1 and 3) deadlocked once global rank 0, the process that launched the others, is
# gone: rank 3 waits in Lightning's per-batch WORLD broadcast from rank 0 (`_broadcast_sigterm_tensor`,
# which also swallows its errors), rank 1 waits in the pipeline for rank 3 and polls an error channel
# that (a) is per pipeline, so it never hears of replica 0's error, and (b) lives in the store hosted by
# rank 0, whose loss `ErrorChannel.first_error` reads as "no error". Lightning kills the children only
# on KeyboardInterrupt, and its child-process observer is a daemon thread of rank 0 that dies with it.
# Reproduced 3/3 (rank 2 raises), 6/6 (rank 0 raises), 3/3 (rank 0 killed); a fixed run ends ~10 s after
# the failure. Fixed: PipeStrategy's error channels also watch job-wide errors and read a lost store as an
# error, and on_exception on the launcher kills the ranks still running after a short grace.
# The bound counts from the failure, not the launch: four processes may take longer than the bound to
# start on a loaded 2-core machine (seen once: 45 s, still initializing).
ORPHAN_WAIT_S = 30.0


@pytest.mark.parametrize("rank, how", [(2, "raise"), (0, "kill")], ids=["rank2_raises", "rank0_killed"])
def test_a_failure_in_replica_zero_mid_accumulation_ends_every_process(tmp_path_factory, rank, how):
    code, seconds, survivors, output, root = _fail(
        tmp_path_factory, f"orphans_{how}_rank{rank}", "--fail-rank", rank, "--fail-epoch", 0, "--fail-batch", 2,
        "--fail-how", how, "--strategy", "pipe", "--devices", 4, "--pipe-size", 2, timeout=HANG_BOUND_S,
    )
    assert code != 0
    assert not survivors, (seconds, survivors, output[-4000:])
    assert _seconds_after_the_failure(root, seconds) < ORPHAN_WAIT_S, (seconds, output[-4000:])


@pytest.mark.parametrize("fail_in", ["hook", "step"])
def test_on_exception_checkpoint_saves_where_every_rank_failed_and_never_waits_where_one_did(tmp_path_factory,
                                                                                             fail_in):
    """Regression (review II): with OnExceptionCheckpoint, rank 1 failing alone in on_train_batch_end hung for good:
    its on_exception gathered the model for the checkpoint while rank 0 waited in Lightning's per-batch broadcast.
    Now a rank failing alone skips the callbacks' on_exception and stops the job, with its own error. A step error
    stops every stage, so all of them run on_exception and the checkpoint is written, loadable."""
    code, seconds, survivors, output, root = _fail(
        tmp_path_factory, f"on_exception_{fail_in}", "--fail-rank", 1, "--fail-epoch", 0, "--fail-batch", 1,
        "--fail-in", fail_in, "--on-exception-checkpoint", "--strategy", "pipe", "--devices", 2, timeout=HANG_BOUND_S,
    )
    assert code != 0 and not survivors, (seconds, survivors, output[-4000:])
    assert _seconds_after_the_failure(root, seconds) < ORPHAN_WAIT_S, (seconds, output[-4000:])
    reasons = stop_reasons(output)
    assert reasons[1].endswith("RuntimeError: injected failure on global rank 1"), reasons
    saved = sorted(os.listdir(root / "on_exception")) if (root / "on_exception").exists() else []
    if fail_in == "hook":
        assert "the other ranks did not all stop within seconds" in output and saved == [], (saved, output[-4000:])
        return
    assert saved == ["on_exception.ckpt"], (saved, output[-4000:])
    checkpoint = torch.load(root / "on_exception" / "on_exception.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 0 and "body.0.weight" in checkpoint["state_dict"]
    assert not any(v.is_meta for v in checkpoint["state_dict"].values())


def test_a_script_catching_an_error_every_rank_raised_goes_on_as_under_ddp(tmp_path_factory):
    """Regression (review NN): every rank raised in a hook and the script caught it; 5 s later the launcher SIGKILLed
    the ranks still running (the script's own recovery code), and the job ended with code 137. Ranks that all
    failed meet (hooks.FailTogether) and none is ended."""
    root = tmp_path_factory.mktemp("caught")
    cmd = [sys.executable, FAULT_APP, "--fail-rank", -1, "--fail-epoch", 0, "--fail-batch", 1, "--fail-in", "hook",
           "--catch", "--strategy", "pipe", "--devices", 2, "--root", str(root), "--out", str(root / "result.pt")]
    (code,), seconds, survivors, (output,) = Launch(root, [list(map(str, cmd))],
                                                    _env(FAULT_STAMP=str(root / "failed_at"))).finish(HANG_BOUND_S)
    assert code == 0 and not survivors, (code, survivors, output[-4000:])
    assert sorted(p.name for p in root.glob("alive_*")) == ["alive_0", "alive_1"], output[-4000:]
    assert (root / "alive_1").read_text() == "injected failure on global rank 1"


def test_resume_after_a_failure_loses_nothing_checkpointed(tmp_path_factory, failed_in_second_epoch, pipe2x2):
    """The checkpoint of epoch 0, written before the failure in epoch 1, resumes to the uninterrupted result."""
    root = failed_in_second_epoch[4]
    assert sorted(os.listdir(root / "ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    last = root / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (0, 2)
    result = _run(
        tmp_path_factory, "resume_2x2", APP, "--strategy", "pipe", "--devices", 4, "--pipe-size", 2,
        "--resume", last,
    )
    _assert_same_weights(result, pipe2x2)
    torch.testing.assert_close(result["predictions"], pipe2x2["predictions"])


def test_a_hung_launch_prints_the_stack_of_every_process_it_started(tmp_path):
    """A hang that fails a test says where each process was: the script and a child it started (Lightning starts
    the other ranks so), both still running when the launch is killed."""
    # the child writes its stack to a file of its own (where the launch's environment turned the fault handler on):
    # two processes writing to one pipe at once interleave their stacks character by character
    child = ("import faulthandler, sys, time\nif faulthandler.is_enabled():\n"
             "    faulthandler.enable(open(sys.argv[1], 'w'))\ndef child_waits():\n    time.sleep(60)\nchild_waits()")
    child_stack = tmp_path / "child_stack.txt"
    script = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}, {str(child_stack)!r}])\n"
              "def parent_waits():\n    time.sleep(60)\nparent_waits()")
    codes, seconds, survivors, (output,) = Launch(tmp_path, [[sys.executable, "-c", script]], _env()).finish(3)
    assert codes == [None] and len(survivors) == 2
    assert "in parent_waits" in output, output
    assert "in child_waits" in child_stack.read_text(), output
    assert not [name for name in os.listdir(ROOT) + os.listdir(tmp_path) if name.startswith("core")]  # no core files
