"""The process tier's harness (tests/trainer_utils.py): acting on a real process at a line of its output."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.trainer_utils import ITER_RE, HeldReader, iteration_at_least

pytestmark = pytest.mark.process


def test_a_held_reader_holds_the_writer_until_released(tmp_path):
    """The multi-process tests act (kill, SIGSTOP) on ranks at iteration k from a test thread that may run late.
    `HeldReader` stops at the line: a writer of 2000 iteration lines, looked at two seconds later, has printed
    about a dozen lines more and no further; once released it runs to the end and every line reaches the sink,
    in order. A writer that ends before the line fails the wait with its output."""
    line = "print(f'iteration {i:8d}/ 2000 | ' + 'x' * 300, flush=True); print(i, file=sys.stderr, flush=True)"
    with open(tmp_path / "written", "w") as written:  # how far the writer got: the number of its last line
        p = subprocess.Popen([sys.executable, "-c", f"import sys\nfor i in range(1, 2001): {line}"],
                             stdout=subprocess.PIPE, stderr=written, text=True, start_new_session=True)
    lines: list[str] = []
    reader = HeldReader(p, lines.append, iteration_at_least(3))
    with reader.held(60) as line:  # released after the block
        assert ITER_RE.search(line).group(1) == "3"
        time.sleep(2)
        last = int((tmp_path / "written").read_text().split()[-1])
        assert p.poll() is None and len(lines) == 3 and 3 <= last < 20, (len(lines), last)
    assert p.wait(timeout=60) == 0
    reader.join(timeout=10)
    assert [int(m.group(1)) for m in map(ITER_RE.search, lines)] == list(range(1, 2001))

    short = subprocess.Popen([sys.executable, "-c", "print('iteration 1/ 2', flush=True)"], stdout=subprocess.PIPE,
                             text=True)
    with pytest.raises(AssertionError, match="before the line to hold at"):
        HeldReader(short, lambda line: None, iteration_at_least(3)).wait_held(60, explain=lambda: "iteration 1")
