"""
Runs that outlive failures (elastic.py, train.py's auto_resume and checkpoint_minutes): a rank killed under
`torchrun --max-restarts`, a rank killed in the middle of a save, a node lost from a job of two, a job requeued by a
real SLURM. Each run goes on by itself with the same command line and ends with the losses and weights of a run
that nothing interrupted (bitwise: exact resume on the CPU), and its log says what the failure cost.

The torchrun tests run 2 ranks on the CPU (gloo). The SLURM test starts a one-machine cluster (munged, slurmctld,
slurmd) from Debian's slurm-wlm and munge, which .ci/run installs; it is skipped where they are not installed.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_run import TINY, tiny

import elastic
import train
from checkpoint import load_checkpoint
from config import ConfigError

REPO = Path(__file__).resolve().parent.parent
# 80 steps of two micro-batches (one per rank), ckpt.pt at every 10th: a kill after a checkpoint leaves most of the
# run to redo, however slowly the test reacts on a busy machine
RUN = {**TINY, "dataset": "shakespeare_char", "gradient_accumulation_steps": 2, "max_iters": 80, "eval_interval": 10}
RUN |= {"log_interval": 1, "tensorboard": True, "dist_timeout": 20, "lr_decay_iters": 0}
SAVED = re.compile(r"saved .*ckpt\.pt")  # an evaluation's "(saved best.pt, by val loss, ckpt.pt)", a stop's, ...
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def train_args(out_dir, **settings):
    """train.py's command line for RUN and settings, with auto_resume, writing into out_dir."""
    settings = {**RUN, **settings, "auto_resume": True, "out_dir": out_dir}
    return [f"--{k}={v}" for k, v in settings.items()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """A process started in a session of its own, its output (stdout and stderr) read line by line on a thread."""

    def __init__(self, command, env, cwd=REPO):
        self.lines, self.seen = [], threading.Condition()
        self.process = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.process.stdout:
            with self.seen:
                self.lines.append(line)
                self.seen.notify_all()

    def wait_for(self, pattern, after=0, timeout=120):
        """The index of the first line from `after` on matching pattern (a regex); fails after timeout seconds."""
        deadline = time.monotonic() + timeout
        with self.seen:
            while True:
                found = next((i for i in range(after, len(self.lines)) if re.search(pattern, self.lines[i])), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None and not self.reader.is_alive():
                    pytest.fail(f"no line matching {pattern!r}; the last lines:\n{''.join(self.lines[-30:])}")
                self.seen.wait(min(left, 1.0))

    def finish(self, timeout=180):
        """Its exit status, once it has ended (it is killed after timeout seconds) and its output is all read."""
        try:
            status = self.process.wait(timeout)
        finally:
            self.kill()
        self.reader.join(10)
        return status

    @property
    def output(self):
        return "".join(self.lines)

    def kill(self):
        """SIGKILL the process and all it started (a torchrun agent's workers run in sessions of their own)."""
        for pid in descendants(self.process.pid) + [self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


def descendants(pid):
    """Linux: the ids of the processes that pid started, and that they started, in that order."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (name) S ppid"
    found = [pid]
    for parent in found:
        found += sorted(child for child, of in parents.items() if of == parent)
    return found[1:]


def rank_of(pid):
    """The RANK that torchrun gave the worker process pid."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


def tensorboard_losses(folder, tag="train/loss"):
    """{step: value} of a TensorBoard tag in folder, over all its event files (a restart writes one more)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def assert_same_run(folder, reference):
    """folder's run ended with reference's weights, optimizer state, train losses and evaluations, bitwise."""
    ours, theirs = load_checkpoint(folder / "ckpt.pt"), load_checkpoint(reference / "ckpt.pt")
    assert ours["iter_num"] == theirs["iter_num"] == RUN["max_iters"]
    assert all(torch.equal(ours["weights"][k], theirs["weights"][k]) for k in theirs["weights"])
    moments = [(ours["optimizers"]["adamw"]["state"][i], s) for i, s in theirs["optimizers"]["adamw"]["state"].items()]
    assert all(torch.equal(mine[k], s[k]) for mine, s in moments for k in s)
    for tag in ("train/loss", "eval/val"):
        expected = tensorboard_losses(reference, tag)
        assert tensorboard_losses(folder, tag) == expected and len(expected) >= RUN["max_iters"] // 10


@pytest.fixture(scope="module")
def env(data_root):
    """
    The environment of train.py's processes: the session's datasets, one thread per rank, and a store of its own for
    each rendezvous round, without which torchrun 2.13 cannot restart its ranks (elastic.torchrun_note).
    """
    return {
        **os.environ,
        "NANOFORMER_DATA_DIR": data_root,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """The run that nothing interrupts: RUN on 2 ranks under torchrun, its folder."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "train.py"), *train_args(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out


# -----------------------------------------------------------------------------
# auto_resume and what a restart says, in one process


def test_auto_resume_starts_a_run_then_goes_on_with_it_and_ends_as_it_did(tmp_path, data_root, capsys):
    """The same settings start the run, go on with it, and a restart after its end trains nothing and says so."""
    settings = dict(max_iters=6, eval_interval=3, auto_resume=True)
    out = tmp_path / "run"
    first = train.main(tiny(data_root, out, **settings))
    straight = train.main(tiny(data_root, tmp_path / "straight", max_iters=9, eval_interval=3))
    capsys.readouterr()
    second = train.main(tiny(data_root, out, **{**settings, "max_iters": 9}))
    assert f"resuming {out / 'ckpt.pt'} at iteration 6" in capsys.readouterr().out
    assert {**first["losses"], **second["losses"]} == straight["losses"]
    done = train.main(tiny(data_root, out, **{**settings, "max_iters": 9}))
    assert done["losses"] == {} and "nothing to train" in capsys.readouterr().out


def test_auto_resume_refuses_a_run_of_other_model_settings_in_one_line(tmp_path, data_root, capsys):
    train.main(tiny(data_root, tmp_path, max_iters=2))
    argv = [f"--{k}={v}" for k, v in {**TINY, "max_iters": 4, "n_layer": 3}.items()]
    argv += ["--dataset=shakespeare_char", f"--data_dir={data_root}", f"--out_dir={tmp_path}", "--auto_resume"]
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert train.cli(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "n_layer=2" in error and "another --out_dir" in error
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_auto_resume_starts_again_only_a_run_of_its_own_job_that_saved_no_checkpoint(tmp_path, data_root, monkeypatch):
    """A job stopped before its first checkpoint (its TensorBoard logs there) starts again; another job's is refused."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    train.main(tiny(data_root, tmp_path, max_iters=2, tensorboard=True))
    (tmp_path / "ckpt.pt").unlink()
    (tmp_path / "best.pt").unlink(missing_ok=True)
    assert json.loads((tmp_path / "config.json").read_text())["job"] == "41"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(ConfigError, match="already holds a run"):
        train.main(tiny(data_root, tmp_path, max_iters=2, tensorboard=True, auto_resume=True))
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    assert sorted(train.main(tiny(data_root, tmp_path, max_iters=2, auto_resume=True))["losses"]) == [1, 2]


def test_a_resume_says_how_many_steps_a_failure_lost(tmp_path, data_root, monkeypatch):
    train.main(tiny(data_root, tmp_path, max_iters=4))
    ckpt = load_checkpoint(tmp_path / "ckpt.pt", weights=False)
    # a run that saved where it stopped, resumed by hand: nothing to say
    assert elastic.restart_note(tmp_path, ckpt) is None
    elastic.record_progress(tmp_path, 7, ckpt["train_seconds"] + 90)
    assert elastic.restart_note(tmp_path, ckpt) == (
        "resumed after a failure from iteration 4: the run had reached iteration 7, so 3 step(s), about 1.5 minutes "
        "of training, were lost and are trained again"
    )
    elastic.record_progress(tmp_path, 4, ckpt["train_seconds"])
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert elastic.restart_note(tmp_path, ckpt) == "resumed after SLURM's requeue 2 from iteration 4: no step lost"


def test_a_mistyped_init_from_names_the_word_it_resembles(tmp_path, data_root, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train.cli(["--init_from=resum", f"--data_dir={data_root}"]) == 2
    assert capsys.readouterr().err.strip().endswith("did you mean --init_from=resume?")
    (tmp_path / "resumed").mkdir()  # a folder of that name is a path, not a typo: no such complaint
    with pytest.raises(ConfigError) as error:
        tiny(data_root, tmp_path, init_from="scrach")
    assert "did you mean --init_from=scratch?" in str(error.value)
    assert train.check_init_from("resumed") is None and train.check_init_from("gpt2") is None


def test_the_checkpoint_clock_saves_each_time_a_step_passes_another_period():
    clock = elastic.CheckpointClock(minutes=1, seconds=50.0)  # a resume at 50 s of the run's time
    assert [clock.due(s) for s in (55.0, 59.9, 60.0, 61.0, 119.0, 185.0, 190.0)] == [
        False,
        False,
        True,
        False,
        False,
        True,
        False,
    ]
    assert not any(elastic.CheckpointClock(minutes=0, seconds=0.0).due(s) for s in (0.0, 1e6))


# -----------------------------------------------------------------------------
# torchrun: a rank killed, a rank killed in a save, checkpoints by the clock, two nodes


KILLED_IN_A_SAVE = """
import os, shutil, signal, sys, torch
import checkpoint, train

def write_file(state, path):
    # after its first restart, rank 0 dies halfway through writing the checkpoint of iteration 40
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "1" and state.get("iter_num") == 40:
        torch.save(state, path)
        os.truncate(path, path.stat().st_size // 2)
        shutil.copyfile(path, path.with_name("half.pt"))  # kept for the test to look at
        os.kill(os.getpid(), signal.SIGKILL)
    write(state, path)

write, checkpoint.write_file = checkpoint.write_file, write_file
sys.exit(train.cli(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_torchrun_restarts_ranks_killed_anywhere_and_the_run_goes_on_exactly(tmp_path, env, reference):
    """
    `torchrun --max-restarts=2` on 2 ranks, the run's own command line. Rank 1 is SIGKILLed once a checkpoint is saved:
    torchrun restarts both ranks, which resume from it. Then rank 0 is SIGKILLed with half of the checkpoint of
    iteration 40 written: the ranks restart again and resume from iteration 30, never reading the half-written file,
    and the log says 10 steps were lost. The run ends as the uninterrupted one did.
    """
    script = tmp_path / "killed_in_a_save.py"
    script.write_text(KILLED_IN_A_SAVE)
    out = tmp_path / "out"
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=2", str(script), *train_args(out)]
    job = Launch(command, {**env, "PYTHONPATH": str(REPO)})
    try:
        job.wait_for(SAVED.pattern)
        os.kill(next(pid for pid in descendants(job.process.pid) if rank_of(pid) == 1), signal.SIGKILL)
        assert job.finish() == 0, job.output[-3000:]
    finally:
        job.kill()
    resumes = [int(i) for i in re.findall(r"^resuming .* at iteration (\d+)", job.output, re.M)]
    assert len(resumes) == 2 and resumes[0] % RUN["eval_interval"] == 0 and resumes[0] < 40, resumes
    assert re.search(
        rf"^resumed after (a failure \()?torchrun's restart 1\)? from iteration {resumes[0]}", job.output, re.M
    )
    # what the kill left was half a checkpoint, and the restart went on from the one before
    with pytest.raises(ConfigError, match="truncated or corrupted"):
        load_checkpoint(out / "half.pt")
    assert resumes[1] == 30 and re.search(
        r"^resumed after a failure \(torchrun's restart 2\) from iteration 30: the run had reached iteration 40, so "
        r"10 step\(s\)",
        job.output,
        re.M,
    )
    assert_same_run(out, reference)


CLOCK_SKEWED = """
import os, sys
import log, train

class Fast(log.Clock):  # rank 1's clock runs three times as fast as rank 0's
    def seconds(self):
        return self.before + 3 * (super().seconds() - self.before)

if os.environ["RANK"] == "1":
    train.Clock = Fast
sys.exit(train.cli(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_checkpoints_by_the_clock_are_agreed_by_ranks_whose_clocks_disagree(tmp_path, env, reference):
    """
    checkpoint_minutes on 2 ranks whose clocks run at different speeds: they save at the same steps (a rank that
    decided alone would wait in a collective the other never joins, until dist_timeout), and the saves change nothing.
    """
    script = tmp_path / "skewed.py"
    script.write_text(CLOCK_SKEWED)
    out = tmp_path / "out"
    run = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), *train_args(out, checkpoint_minutes=0.002)],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    by_clock = [int(i) for i in re.findall(r"^saved .*ckpt\.pt at iteration (\d+), by the clock", run.stdout, re.M)]
    assert len(by_clock) >= 2 and all(i % RUN["eval_interval"] and i < RUN["max_iters"] for i in by_clock)
    assert_same_run(out, reference)


def node(port, out_dir, env):
    """One of two nodes of a torchrun job, as each node of a cluster starts it: one rank, rendezvous on port."""
    rendezvous = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    command = [*TORCHRUN, *rendezvous, "--rdzv-id=nodes", "--max-restarts=1", str(REPO / "train.py")]
    return Launch(command + train_args(out_dir), env)


@pytest.mark.timeout(400)
def test_two_nodes_outlive_a_lost_node_replaced_by_another(tmp_path, env, reference):
    """
    Two torchrun processes meeting at a c10d rendezvous, as two nodes do (`--nnodes=2`). Once a checkpoint is saved
    the second node is killed whole, its torchrun and its rank (which torchrun starts in a session of its own). The
    first node's torchrun restarts its rank and waits in the rendezvous; a new second node, started with the same
    command line as a cluster replaces a lost node, joins it, and the run goes on from that checkpoint by itself.
    """
    port = free_port()
    first = node(port, tmp_path, env)
    time.sleep(1)  # the first to start hosts the rendezvous, as the job's first node does on a cluster
    second = node(port, tmp_path, env)
    replacement = None
    try:
        first.wait_for(SAVED.pattern)
        second.kill()
        first.wait_for(r"failed \(exitcode")  # the first node's rank lost its peer; its torchrun waits for a node
        replacement = node(port, tmp_path, env)
        statuses = [first.finish(), replacement.finish()]
        assert statuses == [0, 0], first.output[-3000:] + replacement.output[-3000:]
    finally:
        for launch in (first, second, replacement):
            if launch is not None:
                launch.kill()
    at = int(re.search(r"^resuming .* at iteration (\d+)", first.output, re.M).group(1))
    assert at % RUN["eval_interval"] == 0 and 0 < at < RUN["max_iters"]
    assert re.search(rf"^resumed after (a failure \()?torchrun's restart 1\)? from iteration {at}", first.output, re.M)
    assert_same_run(tmp_path, reference)


def test_torchrun_restarts_without_a_store_per_round_are_said_to_fail(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in elastic.torchrun_note()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what that variable makes it
    assert elastic.torchrun_note() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert elastic.torchrun_note() is None


@pytest.mark.timeout(120)
def test_the_interconnect_check_sums_and_times_every_size(env):
    """slurm/all_reduce.py on 2 CPU ranks: every sum right, a bandwidth for each size, 1 to 16 MiB."""
    run = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "slurm" / "all_reduce.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = re.findall(r"^ +(\d+) MiB +[\d.]+ ms +([\d.]+) GB/s$", run.stdout, re.M)
    assert [int(size) for size, _ in sizes] == [1, 4, 16] and all(float(bus) > 0 for _, bus in sizes), run.stdout


# -----------------------------------------------------------------------------
# SLURM: slurm/train.sbatch on a one-machine cluster, stopped before its time limit and requeued


SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
SLURM_CONF = """\
ClusterName=nanoformer-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/socket/munge.socket
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobRequeue=1
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def until(check, timeout, what):
    """Poll check() every half second until it returns something true, which is returned; fails after timeout."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.5)
    return found


@pytest.fixture(scope="module")
def slurm():
    """
    A SLURM cluster of this machine alone (2 CPUs), its daemons run as root from a temporary folder: munged with a
    key of its own, slurmctld and slurmd. Yields the environment its commands need (SLURM_CONF); the jobs are
    cancelled and the daemons stopped afterwards, whatever happened.
    """
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("a one-machine SLURM cluster runs its daemons as root")
    folder = Path(tempfile.mkdtemp(prefix="nanoformer-slurm-"))
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}  # where every SLURM command finds the cluster
    daemons = []
    try:
        # munged: its key readable by root alone, its socket in a folder every user may enter
        for name, mode in (("munge", 0o700), ("socket", 0o755), ("state", 0o755), ("spool", 0o755)):
            (folder / name).mkdir(mode=mode)
        folder.chmod(0o755)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge = ["munged", "--foreground", f"--key-file={key}", f"--socket={folder}/socket/munge.socket"]
        munge += [f"--{f}-file={folder}/munge/munged.{f}" for f in ("pid", "log", "seed")]
        daemons.append(subprocess.Popen(munge, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        until(lambda: (folder / "socket" / "munge.socket").exists(), 30, f"munged's socket ({folder}/munge/munged.log)")
        host = socket.gethostname().split(".")[0]
        (folder / "slurm.conf").write_text(
            SLURM_CONF.format(host=host, folder=folder, ports=(free_port(), free_port()))
        )
        for daemon in ("slurmctld", "slurmd"):
            command = [daemon, "-D", "-f", env["SLURM_CONF"]]
            daemons.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        until(lambda: slurm_command(env, "sinfo", "-h", "-o", "%t") == "idle", 60, f"the node ({folder}/slurm*.log)")
        yield env
    finally:
        if len(daemons) > 1:  # slurmctld started: its jobs are cancelled, and their steps end within KillWait
            slurm_command(env, "scancel", "--user=root")
            with contextlib.suppress(pytest.fail.Exception):
                until(lambda: not slurm_command(env, "squeue", "-h"), 60, "the jobs to end")
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(folder, ignore_errors=True)


def slurm_command(env, *command):
    """The output of a SLURM command (scontrol, sinfo, ...), stripped; "" if it failed."""
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    return run.stdout.strip() if run.returncode == 0 else ""


@pytest.mark.timeout(700)
def test_a_slurm_job_stopped_at_its_time_limit_and_requeued_goes_on_exactly(slurm, tmp_path, env, reference):
    """
    slurm/train.sbatch as it is (one node, here 2 ranks on 2 CPUs). First the warning of its time limit, USR1 to the
    batch script alone (what --signal=B:USR1@300 sends): the ranks save and the script requeues the job. Then, running
    again, `scontrol requeue` (what a preemption does): SLURM sends SIGTERM to every process of the job, the ranks
    save and it is queued again. A requeued job waits for its BeginTime, two minutes on: the test moves it to now.
    The job's log, appended to, says each resume, and the run ends as the uninterrupted one did.
    """
    log, out = tmp_path / "job.out", tmp_path / "out"
    # torchrun from this Python's folder; the rendezvous on a free port
    job_env = {**env, **slurm, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    job_env |= {"NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port())}
    submit = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2", f"--output={log}"]
    run = subprocess.run(
        [*submit, "slurm/train.sbatch", *train_args(out)],
        env=job_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    job = run.stdout.strip()

    def state():
        found = re.search(r"JobState=(\w+)", slurm_command(slurm, "scontrol", "show", "job", job))
        return found.group(1) if found else ""

    def saved_in(attempt):  # a checkpoint saved by the job's attempt after `attempt` requeues
        text = log.read_text() if log.exists() else ""
        return (
            SAVED.search(text.split(f"(requeued {attempt} times)")[-1])
            if f"(requeued {attempt} times)" in text
            else None
        )

    pending_since = {}

    def started_again(attempt):
        # a requeued job waits for its BeginTime, two minutes on: moved to now, a few seconds after it is queued. slurmd
        # revokes the previous run's credential by the second: a start in the same second fails at once ("Job
        # credential revoked"), which SLURM's own two minutes never meet
        if state() == "PENDING":
            pending_since.setdefault(attempt, time.monotonic())
            if time.monotonic() - pending_since[attempt] > 3:
                slurm_command(slurm, "scontrol", "update", f"jobid={job}", "StartTime=now")
        return saved_in(attempt)

    until(lambda: saved_in(0), 120, "the first checkpoint")
    slurm_command(slurm, "scancel", "--batch", "--signal=USR1", job)
    until(lambda: started_again(1), 180, "a checkpoint of the requeued job")
    slurm_command(slurm, "scontrol", "requeue", job)
    until(lambda: started_again(2), 180, "a checkpoint of the job requeued again")
    until(lambda: state() not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"), 180, "the job to end")
    text = log.read_text()
    assert state() == "COMPLETED", text[-3000:]
    stops = [int(i) for i in re.findall(r"^stopped by SIGTERM at iteration (\d+)", text, re.M)]
    resumes = [
        int(i) for i in re.findall(r"^resumed after SLURM's requeue \d from iteration (\d+): no step lost", text, re.M)
    ]
    assert len(stops) == 2 and resumes == stops and "time limit near" in text, text[-3000:]
    assert_same_run(out, reference)
