"""The agent's stdin watch (the controller holds the agent's stdin open; EOF means it is gone):
an agent that ends while its controller still holds the pipe exits cleanly. Blocked in
sys.stdin's buffer, the watching thread held the buffer's lock, and the interpreter's shutdown,
taking it to close stdin, aborted the agent (exit 134, "Fatal Python error")."""
from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import threading, time
from types import SimpleNamespace
from ffctl.agent.agent import Agent
agent = SimpleNamespace(stopping=threading.Event())
threading.Thread(target=Agent._watch_stdin, args=(agent,), daemon=True).start()
time.sleep(0.3)  # the thread is blocked reading by now
"""


def test_an_agent_ending_while_its_controller_holds_stdin_exits_cleanly() -> None:
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        err = proc.stderr.read()  # until the program ends: its stdin is still open
        code = proc.wait(timeout=60)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.kill()
    assert code == 0 and "Fatal Python error" not in err, err


def test_the_watch_sets_stopping_when_stdin_closes() -> None:
    program = PROGRAM.replace("time.sleep(0.3)  # the thread is blocked reading by now",
                              "assert agent.stopping.wait(60)")
    proc = subprocess.run([sys.executable, "-c", program], input="", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
