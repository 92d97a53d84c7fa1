"""Zero-signal monitor, run names and the stdout/stderr tee: no model needed."""

import subprocess
import sys

import pytest

from trl_ext.cli_train import parser
from trl_ext.monitor import ZeroSignalMonitor
from trl_ext.naming import fmt_value, run_name


def test_monitor_warns_after_patience_and_resets():
    m = ZeroSignalMonitor(patience=3)
    assert m.update(1.0, 1) is None and m.update(1.0, 2) is None
    text = m.update(1.0, 3)
    assert "NO LEARNING SIGNAL" in text and "3 steps in a row" in text and "step 3" in text
    assert m.update(0.5, 4) is None and m.streak == 0  # one group with spread resets the streak
    assert [m.update(1.0, s) is not None for s in range(5, 11)] == [False, False, True, False, False, True]
    assert m.warnings == 3


@pytest.mark.parametrize(
    "value,expected",
    [(1e-4, "1e-4"), (3e-4, "3e-4"), (2.5e-5, "2.5e-5"), (0.02, "0.02"), (1e-2, "0.01"), (0.0, "0"),
     (1e10, "1e10"), (True, "true"), ("a/b c", "a-b-c"), ([1, 2], "1-2")],
)  # fmt: skip
def test_fmt_value(value, expected):
    assert fmt_value(value) == expected


def _name(*flags):
    run, cfg = parser().parse_args_into_dataclasses(args=["--reward", "happy_binary", *flags])
    d_run, d_cfg = parser().parse_args_into_dataclasses(args=["--reward", "happy_binary"])
    return run_name(run, cfg, d_run, d_cfg, "full")


def test_run_name_core_and_extras():
    assert _name("--lr", "1e-4") == "happy_binary_builtin_lr1e-4_b0.02_bs32_ng16_full_st2000_s42"
    # a non-default defining field is appended; logging-only fields are not
    assert _name("--temperature", "0.7", "--logging_steps", "3", "--no_wandb", "true") == (
        "happy_binary_builtin_lr1e-5_b0.02_bs32_ng16_full_st2000_s42_temperature0.7"
    )
    assert _name("--max_completion_length", "32") != _name("--max_completion_length", "48")
    assert _name("--model", "/tmp/some/ckpt/") == "happy_binary_ckpt_lr1e-5_b0.02_bs32_ng16_full_st2000_s42"


def test_tee_captures_python_and_fd_level_output(tmp_path):
    log = tmp_path / "train.log"
    code = (
        "import os, sys\n"
        "from trl_ext.runlog import Tee\n"
        f"t = Tee({str(log)!r})\n"
        "print('to stdout'); print('to stderr', file=sys.stderr)\n"
        "os.system('echo from a subprocess')\n"
        "t.close(); print('after close')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    text = log.read_text()
    assert "to stdout" in text and "to stderr" in text and "from a subprocess" in text
    assert "after close" not in text
    assert "to stdout" in out.stdout and "after close" in out.stdout and "to stderr" in out.stderr
