"""A child's exit said as what it was: a SIGKILL while the kernel counted an out-of-memory kill is the kernel's,
with the trainer's memory estimate from its log and the flags to try; a SIGKILL it did not count is not."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from agentstream.demo.run import Demo, Running, StackConfig
from agentstream.stack import StackError
from agentstream.stack.exits import how_it_ended, oom_kills
from agentstream.stack.process import spawn

ESTIMATE_LINE = ("2026-12-06 08:00:00 trainer INFO memory: peak estimate 31.4 GiB (weights 1.8, gradients 1.8, "
                 "AdamW 3.7, activations 18.4, logits 4.6, runtime 0.9), available 20.5 GiB (MemAvailable)\n")


def killed_child(log: Path) -> int:
    """A child that wrote the trainer's start-up line, then was killed with SIGKILL: its exit code."""
    proc = spawn([sys.executable, "-c", f"import sys, time; sys.stdout.write({ESTIMATE_LINE!r}); sys.stdout.flush(); "
                                        "time.sleep(60)"], log)
    deadline = time.monotonic() + 30
    while "peak estimate" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=30)


def vmstat(path: Path, kills: int) -> Path:
    path.write_text(f"nr_free_pages 1000\noom_kill {kills}\npgfault 5\n")
    return path


def test_a_sigkill_while_the_kernel_counted_an_oom_kill_is_the_kernels(tmp_path):
    log = tmp_path / "trainer.log"
    code = killed_child(log)
    assert code == -signal.SIGKILL
    said = how_it_ended(code, log, oom_kills_before=9, vmstat=vmstat(tmp_path / "vmstat", 10))
    assert said == ("was killed by the kernel, out of memory (peak estimate 31.4 GiB, available 20.5 GiB): "
                    "try --gradient-checkpointing / --micro-batch-size 1")
    # through a shell: 128 + 9
    assert how_it_ended(137, log, 9, vmstat(tmp_path / "vmstat", 11)).startswith("was killed by the kernel")


def test_a_sigkill_the_kernel_did_not_count_is_not_called_out_of_memory(tmp_path):
    log = tmp_path / "trainer.log"
    counted = vmstat(tmp_path / "vmstat", 4)
    said = how_it_ended(killed_child(log), log, oom_kills_before=4, vmstat=counted)
    assert said == "was killed by SIGKILL, not by the kernel's out-of-memory killer (it counted no kill meanwhile)"


def test_without_the_kernels_count_a_sigkill_is_most_likely_memory(tmp_path):
    log = tmp_path / "other.log"
    log.write_text("no estimate here\n")
    said = how_it_ended(-signal.SIGKILL, log, None, vmstat=tmp_path / "missing")
    assert said == "was killed by SIGKILL, most likely by the kernel, out of memory"


def test_other_exits_are_said_plainly(tmp_path):
    log = tmp_path / "x.log"
    assert how_it_ended(2, log, 0) == "exited with code 2"
    assert how_it_ended(-signal.SIGTERM, log, 0) == "was killed by SIGTERM"


def test_the_kernels_count_is_read_from_vmstat(tmp_path):
    assert oom_kills(vmstat(tmp_path / "vmstat", 7)) == 7
    assert oom_kills(tmp_path / "missing") is None
    if Path("/proc/vmstat").exists():
        assert isinstance(oom_kills(), int)


def test_the_loop_reports_its_killed_trainer(tmp_path):
    """Demo.check_alive, the loop's supervisor: the trainer's SIGKILL named, beside the log's tail."""
    demo = Demo(StackConfig(out=tmp_path / "run"), Console(quiet=True))
    log = tmp_path / "trainer.log"
    before = oom_kills()
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)"], log)
    demo.running.append(Running("trainer", proc, log, before))
    demo.check_alive()  # alive: nothing to say
    log.write_text(ESTIMATE_LINE)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    with pytest.raises(StackError) as failed:
        demo.check_alive()
    message = str(failed.value)
    assert message.startswith("the trainer was killed")
    assert "peak estimate 31.4 GiB" in message  # the log's tail follows
    if before is not None and oom_kills() == before:  # (another process on the machine may have been OOM-killed)
        assert "not by the kernel's out-of-memory killer" in message
