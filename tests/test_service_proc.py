"""tests/support/stack.py's Proc, the one way tests run a service process: its output is read to the end in
the background, so a process that keeps printing after its ready line (a gateway logs a line per request:
~64 KB of pipe fill in ~300 requests) never blocks on a full pipe, and waiting for a line has a real
deadline."""
from __future__ import annotations

import sys

import pytest

from tests.support.stack import OUTPUT_HEAD, OUTPUT_TAIL, Proc

# Ready, then ~300 KB in 6,000 lines (more than a pipe holds and than Proc keeps), then a last line; it
# exits only once all of it is written.
CHATTY = ("import sys\n"
          "print('SERVICE READY at 1', flush=True)\n"
          "for i in range(6000):\n"
          "    sys.stdout.write(f'access line {i:05d} ' + 'x' * 30 + '\\n')\n"
          "print('LAST LINE', flush=True)\n")


def test_a_chatty_process_never_blocks_and_every_line_is_seen():
    p = Proc(cmd=[sys.executable, "-c", CHATTY], ready="SERVICE READY")
    try:
        assert p.ready_line == "SERVICE READY at 1\n"
        # Nobody asks for its output now: it must still get all of it written and exit.
        assert p.wait(60) == 0
        assert p.wait_line("LAST LINE", 30) == "LAST LINE\n"
        assert p.wait_line("SERVICE READY", 1) == "SERVICE READY at 1\n"  # read before the call: still found
        assert p.count == 6002
        lines = p.lines
        assert len(lines) == OUTPUT_HEAD + OUTPUT_TAIL  # the first and the last are kept, the middle dropped
        assert lines[1] == "access line 00000 " + "x" * 30 + "\n" and lines[-1] == "LAST LINE\n"
        assert p.since(6000) == ["access line 05999 " + "x" * 30 + "\n", "LAST LINE\n"]
    finally:
        p.stop()


def test_waiting_for_a_line_that_never_comes_ends_at_the_deadline():
    p = Proc(cmd=[sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(120)"])
    try:
        with pytest.raises(TimeoutError, match="(?s)no line starting 'READY'.*starting"):
            p.wait_line("READY", timeout=1.0)
        assert p.alive()
    finally:
        p.stop()
    assert not p.alive()


def test_a_process_that_exits_first_is_an_error_quoting_its_output():
    with pytest.raises(RuntimeError, match="(?s)exited \\(code 3\\) before printing 'READY'.*bad flag"):
        Proc(cmd=[sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"], ready="READY", timeout=60)
