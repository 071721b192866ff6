"""A PyTorch job under `ckpt resume` (issue 15 §3): the rank environment and heartbeats from
Python, and python/examples/tiny_gpt.py (DDP, 2 CPU ranks, gloo) under the real `ckpt resume`
with one rank SIGKILLed midway, ending with the weights of an uninterrupted run."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckpt
from ckpt.dcp import StorageWriter
from conftest import ROOT

EXAMPLE = ROOT / "python" / "examples" / "tiny_gpt.py"
# 60 steps of about 50 ms or more each, a checkpoint every 10: the kill lands midway.
STEPS = 60
TRAIN = ["--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0.05"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_env(sock: Path, **over) -> dict:
    """The variables `ckpt resume` sets for rank 1 of generation 4 (see RankEnv::to_env)."""
    env = {
        "CKPT_STORE": "/tmp/nowhere",
        "CKPT_RUN": "py",
        "CKPT_RANK": "1",
        "CKPT_WORLD_SIZE": "2",
        "CKPT_LAYOUT": "dp=2,tp=1,pp=1",
        "CKPT_GENERATION": "4",
        "CKPT_RESUME": "true",
        "CKPT_RESUME_STEP": "20",
        "CKPT_NODE": "1",
        "CKPT_LOCAL_RANK": "0",
        "CKPT_FINAL_ON_SIGTERM": "0",
        "CKPT_SUPERVISOR_PID": str(os.getpid()),
        "CKPT_HEARTBEAT": str(sock),
        "CKPT_HEARTBEAT_MS": "50",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
    }
    env.update(over)
    return env


def test_outside_a_driver_there_is_no_rank_environment_and_heartbeats_do_nothing(monkeypatch):
    monkeypatch.delenv("CKPT_SUPERVISOR_PID", raising=False)
    assert ckpt.resume_env() is None
    hb = ckpt.Heartbeat()
    assert not hb.active
    hb.step(3, loss=1.5, samples=4)  # nothing to send to, no error


def test_a_launched_rank_reads_its_environment_and_beats_its_steps_and_loss(
    tmp_path, monkeypatch
):
    sock_path = tmp_path / "hb.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(sock_path))
    server.settimeout(5)
    for k, v in launched_env(sock_path).items():
        monkeypatch.setenv(k, v)
    env = ckpt.resume_env()
    assert (env.store, env.run, env.rank, env.world_size) == ("/tmp/nowhere", "py", 1, 2)
    assert (env.generation, env.resume_step, env.node, env.local_world_size) == (4, 20, 1, 1)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29511)
    assert env.heartbeat_interval == 0.05 and "generation=4" in repr(env)
    # A DCP save under the driver writes as the rank's generation, not the newest started.
    assert StorageWriter(str(tmp_path / "s"), run="py", step=1).generation == 4
    assert StorageWriter(str(tmp_path / "s"), run="other", step=1).generation == 0

    hb = ckpt.Heartbeat()
    assert hb.active
    hb.step(21, loss=2.0, samples=8)
    beats = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(b["step"] == 21 for b in beats):
        beats.append(json.loads(server.recv(4096)))
    with_step = [b for b in beats if b["step"] == 21]
    assert with_step, beats
    b = with_step[0]
    assert (b["generation"], b["rank"]) == (4, 1), b
    sums = b["workload"]["sums"]
    assert int(sums["samples"]) == 8
    assert int(sums["loss_sum"]) == 16 * 2**40, sums  # 8 samples at 2.0, fixed point
    fig = b["workload"]["figures"][0]
    assert (fig["curve"], fig["sum"], fig["per"]) == ("loss", "loss_sum", "samples"), fig
    # The thread keeps beating the last step in between.
    while True:
        b = json.loads(server.recv(4096))
        if "workload" not in b:
            assert b["step"] == 21, b
            break
    del hb

    # `ckpt.beat` is the same on a process-wide heartbeat (here in a process of its own).
    beat = "import ckpt; ckpt.beat(5); ckpt.beat(6, loss=0.5, samples=2)"
    subprocess.run([sys.executable, "-c", beat], check=True, timeout=60)
    while True:
        b = json.loads(server.recv(4096))
        if b["step"] == 6 and "workload" in b:
            assert int(b["workload"]["sums"]["loss_sum"]) == 2**40, b
            break

    # A malformed variable is named.
    monkeypatch.setenv("CKPT_GENERATION", "four")
    with pytest.raises(ckpt.CkptError, match="CKPT_GENERATION"):
        ckpt.resume_env()
    server.close()


def ranks_of(run: str) -> dict:
    """Live rank processes of `run` under a supervisor: {(generation, rank): pid}."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        vars_ = dict(v.decode(errors="replace").split("=", 1) for v in env if b"=" in v)
        if vars_.get("CKPT_RUN") != run or "CKPT_SUPERVISOR_PID" not in vars_ or state == "Z":
            continue
        out[(int(vars_["CKPT_GENERATION"]), int(vars_["CKPT_RANK"]))] = int(d.name)
    return out


def uninterrupted(tmp_path: Path) -> dict:
    """The example's 2 ranks launched as torchrun would (its variables only), never stopped."""
    out = tmp_path / "reference.json"
    port = str(free_port())
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.pop("CKPT_SUPERVISOR_PID", None)
        procs.append(subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--store", str(tmp_path / "ref-store"), "--run",
             "reference", *TRAIN, "--digest-out", str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    return json.loads(out.read_text())


def test_tiny_gpt_killed_midway_under_ckpt_resume_ends_as_an_uninterrupted_run(tmp_path, ckpt_bin):
    want = uninterrupted(tmp_path)
    assert want["resumed_from"] is None and want["world"] == 2

    store, logs, out = tmp_path / "store", tmp_path / "logs", tmp_path / "final.json"
    run = "tiny-gpt"
    # Two nodes of one rank and a spare: the job restarts as 2 ranks after a node fails.
    sup = subprocess.Popen(
        [str(ckpt_bin), "--json", "--store", str(store), "resume", "--run", run,
         "--nodes", "2", "--ranks-per-node", "1", "--spares", "1", "--backoff", "100ms",
         "--stop-grace", "5s", "--heartbeat-timeout", "10s", "--startup-timeout", "2m",
         "--logs", str(logs), "--",
         sys.executable, str(EXAMPLE), *TRAIN, "--digest-out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait for the first committed checkpoint, then SIGKILL rank 1 of the first generation.
        first = None
        deadline = time.monotonic() + 120
        while first is None:
            assert sup.poll() is None, f"ckpt resume ended early: {sup.communicate()}"
            assert time.monotonic() < deadline, "no checkpoint committed within 2 minutes"
            if store.exists():
                steps = ckpt.Store(str(store)).committed_steps(run)
                first = steps[0] if steps else None
            time.sleep(0.05)
        live = ranks_of(run)
        gen0 = min(g for g, _ in live)
        os.kill(live[(gen0, 1)], signal.SIGKILL)
        committed_at_kill = ckpt.Store(str(store)).committed_steps(run)
        assert committed_at_kill[-1] < STEPS, "the job was over before the kill"
        stdout, stderr = sup.communicate(timeout=180)
    finally:
        if sup.poll() is None:
            sup.kill()
    rank_logs = "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(logs.glob("rank-*")))
    assert sup.returncode == 0, f"{stdout}\n{stderr}\n{rank_logs}"
    report = json.loads(stdout)
    assert report["ok"] and report["restarts"] == 1, report

    # The recovery log: the killed rank's failure, the restart from a committed step.
    kinds = lambda k: [r for r in report["records"] if r["kind"] == k]  # noqa: E731
    (failure,) = kinds("failure")
    assert (failure["generation"], failure["rank"], failure["how"]) == (gen0, 1, "signal"), failure
    (decision,) = kinds("recovery")
    step = decision["step"]
    assert step is not None and first <= step < STEPS, (decision, committed_at_kill)
    assert decision["layout"].startswith("dp=2"), decision
    started = kinds("started")
    assert [s["generation"] for s in started] == [gen0, gen0 + 1], started
    assert started[1]["resume_from"] == step and 1 not in started[1]["nodes"], started
    assert kinds("resumed"), report["records"]

    # The resumed generation restored that step (and did not train from scratch) ...
    got = json.loads(out.read_text())
    assert (got["resumed_from"], got["generation"], got["world"]) == (step, gen0 + 1, 2), got
    assert f"restored step {step} of {run}" in (logs / f"rank-1.gen-{gen0 + 1}.out").read_text()
    # ... and ends with the weights and optimizer state of the run that never stopped.
    assert got["digest"] == want["digest"], (got, want, rank_logs)
    assert got["loss"] == want["loss"]
    # The supervisor logged the job's loss of every step the resumed generation trained,
    # totalled from both ranks' heartbeats (the metrics log, FORMAT.md "Logs").
    losses = {}
    for part in (store / "runs" / run / "metrics").glob("*.jsonl"):
        for line in part.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "step" and r.get("generation") == gen0 + 1:
                losses[r["step"]] = r.get("loss")
    assert sorted(losses) == list(range(step + 1, STEPS + 1)), sorted(losses)
    assert all(v is not None and 0 < v < 10 for v in losses.values()), losses

    # Every committed step of the run verifies, and the final one is the last step.
    v = subprocess.run([str(ckpt_bin), "--store", str(store), "verify", run],
                       capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    assert ckpt.Store(str(store)).latest_committed(run) == STEPS


def test_ckpt_dcp_takes_each_machines_tier_and_ranks_from_ckpt_agent(tmp_path, monkeypatch):
    # `ckpt agent --local-tier` gives each machine's ranks its tier and their list; ckpt.dcp
    # commits this machine's ranks there (a node commit) rather than refusing.
    from ckpt.dcp import _local_tier

    tier = tmp_path / "tier"
    env = launched_env(
        tmp_path / "hb.sock", CKPT_LOCAL_TIER=str(tier), CKPT_LOCAL_TIER_RANKS="1,3"
    )
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got, node = _local_tier(None, "py", None)
    assert got is not None and got.url == str(tier) and node == [1, 3]
    # Given ranks win over the agent's; another run's job gets nothing from the environment.
    assert _local_tier(None, "py", [1])[1] == [1]
    assert _local_tier(None, "other", None) == (None, None)
    # One tier for every rank (`ckpt resume --local-tier`): no machine's list.
    monkeypatch.delenv("CKPT_LOCAL_TIER_RANKS")
    got, node = _local_tier(None, "py", None)
    assert got.url == str(tier) and node is None
