"""What a person sees: `k3ray train` in a terminal (where the job writes, how to steer it, one live bar, a log line
every N steps, a readable summary) and errors as one line with where to look, never a traceback."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

from conftest import REPO


def run_in_terminal(args: list[str], timeout_s: float = 300) -> tuple[int, str]:
    """Run `python -m k3ray ARGS` with stdout and stderr on a pseudo-terminal; return (exit code, output)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "k3ray", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower)
    os.close(follower)
    chunks, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the terminal closed: every writer has exited
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return code, b"".join(chunks).decode(errors="replace")


def test_train_in_a_terminal_then_resume_with_another_model_size(ray_cluster, tmp_path):
    """`k3ray train` in a terminal shows where the job writes, how to steer it, one live bar, the log lines and a
    readable summary; resuming its checkpoint with another model size then fails with one line naming the field,
    and the checkpoint is untouched."""
    # The default topology (pp=2 x ep=2), 6 steps, a log line every 5 steps: lines for steps 0 and 5 only.
    common = ["--address", ray_cluster.address, "--set", "name=console", "--set", "train.eval_every=0",
              "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "data.micro_batch_size=2"]
    code, out = run_in_terminal(["train", "--config", "configs/tiny.yaml", "--steps", "6", *common,
                                 "--set", "train.log_every=5"])
    assert code == 0, out[-3000:]
    assert "Traceback" not in out
    assert "4 workers (pp 2 x ep 2)" in out
    assert "control API  http://127.0.0.1:" in out and "k3ray status --job console" in out
    assert f"checkpoints  {tmp_path / 'ckpt'}" in out
    assert "6/6 [" in out and "loss=" in out and "tok_s=" in out and "maxvio=" in out  # the live bar
    steps_logged = [line.split("step=")[1].split()[0] for line in out.splitlines() if "step=" in line]
    assert steps_logged == ["0", "5"], out[-3000:]
    assert "k3ray: done: 6 steps" in out and "incidents    none" in out
    assert "snapshots    " in out and " ms (median) / " in out and "0 skipped" in out  # the stall they cost
    assert '{"summary"' not in out  # JSON only with --json
    written = tmp_path / "ckpt" / "step_000000006" / "manifest.json"
    assert written.exists()

    wider = subprocess.run([sys.executable, "-m", "k3ray", "train", "--config", "configs/tiny.yaml", "--steps", "8",
                            "--resume", "--no-progress", "--set", "model.d_model=96", *common], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert wider.returncode == 1
    assert "Traceback" not in wider.stderr + wider.stdout
    errors = [line for line in wider.stderr.splitlines() if line.startswith("k3ray:")]
    assert len(errors) == 1, wider.stderr[-3000:]
    assert "model.d_model: checkpoint 64, config 96" in errors[0] and "details: runs/error-" in errors[0]
    assert written.exists()  # the checkpoint is untouched


def test_bad_cli_input_is_one_line_without_traceback():
    cases = [
        (["train", "--config", "configs/tiny.yaml", "--steps", "0"], "--steps: 0 must be positive"),
        (["train", "--config", "configs/tiny.yaml", "--pp", "0"], "--pp: 0 must be positive"),
        (["train", "--config", "configs/tiny.yaml", "--set", "parallel.pp=[1"], "'parallel.pp=[1': the value is not"),
        (["train", "--config", "configs/tiny.yaml", "--address", "127.0.0.1:1"], "no Ray cluster answers there"),
        (["train", "--config", "configs/missing.yaml"], "configs/missing.yaml"),
    ]
    for args, want in cases:
        done = subprocess.run([sys.executable, "-m", "k3ray", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, (args, done.stderr)
        assert want in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
