"""Fleet's RQ worker stops on SIGTERM whatever it is doing (the kubelet's SIGTERM is how a
pod's RQ worker is retired), on a real redis-server.

Both interleavings below were found by SIGTERMing ``fleet rq-worker`` at random moments (CI
had a pod that outlived its 30 s grace period, and a retired pod that died of the signal):

- RQ's ``unsubscribe`` sends UNSUBSCRIBE, then stops its pub/sub thread, and redis-py 8's
  ``stop()`` waits for the thread. When the thread reads the UNSUBSCRIBE's reply before the
  stop, it goes back to waiting for a message, 60 s (RQ's ``sleep_time``): the warm shutdown of
  an idle worker took a minute and the kubelet SIGKILLed it first.
- RQ installs its SIGTERM handler only after it has registered the worker and started its
  scheduler. A SIGTERM in between killed the process outright: exit -15, its entry left in
  RQ's registry and its scheduler process orphaned, holding the scheduler's lock.

Each test forces its interleaving; neither sleeps to make it happen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import pytest
import redis

from stores import rqjobs
from tests.conftest import RedisServer
from tests.integration.conftest import wait_until
from worker.rq import rq_worker

pytestmark = pytest.mark.integration
QUEUE = "writeback"


def parked(thread: threading.Thread) -> bool:
    """Whether ``thread`` waits in an ``Event.wait`` (redis-py's ``get_message`` while it is not
    subscribed) rather than reading its socket."""
    frame: FrameType | None = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("threading.py"):
            return True
        frame = frame.f_back
    return False


def bounded(call: Callable[[], object], timeout: float) -> bool:
    """Run ``call`` in a thread; whether it returned within ``timeout`` (a hang detector)."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


def test_unsubscribe_returns_when_the_pubsub_thread_reads_the_reply_before_it_is_stopped(
        redis_server: RedisServer, r: redis.Redis) -> None:
    w = rq_worker.build(redis_server.client(), [QUEUE], "rq-unsub")
    w.subscribe()
    thread, pubsub = w.pubsub_thread, w.pubsub
    assert thread is not None and pubsub is not None
    wait_until(lambda: pubsub.subscribed, 5, "the subscription")
    send = pubsub.unsubscribe

    def unsubscribe_then_let_the_thread_read_it(*args: object) -> object:
        sent = send(*args)
        # the thread reads the reply and waits again for a message (or, once told to stop, ends)
        wait_until(lambda: not thread.is_alive() or (not pubsub.subscribed and parked(thread)), 10,
                   "the pub/sub thread to read the UNSUBSCRIBE's reply")
        return sent

    pubsub.unsubscribe = unsubscribe_then_let_the_thread_read_it  # type: ignore[method-assign]
    assert bounded(w.unsubscribe, 10), "unsubscribe waited on a pub/sub thread parked for 60 s"
    wait_until(lambda: not thread.is_alive(), 5, "the pub/sub thread to end")


@dataclass
class Ended:
    """How a worker script's process ended: its exit code (None: still running after the
    deadline, then SIGKILLed), its output, and whether its scheduler process outlived it."""

    code: int | None
    text: str
    scheduler_left: bool


def run_worker_script(script: str, env: dict[str, str], log: Path, timeout: float = 20) -> Ended:
    """Run a ``fleet rq-worker`` script that prints its scheduler's pid (``scheduler-pid N``, in
    one write: the scheduler's own log lines share the file); its output goes to a file, not a
    pipe (an orphaned scheduler would hold a pipe open)."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
        code, text = proc.poll(), log.read_text()
        scheduler = int(text.split("scheduler-pid ", 1)[1].split()[0])
        return Ended(code, text, os.path.exists(f"/proc/{scheduler}"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the worker left in its process group
        proc.wait()


# A ``fleet rq-worker`` whose SIGTERM arrives right after RQ started its scheduler, before RQ
# installs its own handler (the test's copy of the worker's ``_start_scheduler`` signals itself).
SIGTERM_BEFORE_RQ_HANDLERS = textwrap.dedent("""
    import os, signal, sys
    from worker.rq import rq_worker

    base = rq_worker.FleetWorker._start_scheduler

    def start_then_sigterm(self, *args, **kwargs):
        base(self, *args, **kwargs)
        assert self.scheduler is not None and self.scheduler._process is not None
        os.write(1, b"scheduler-pid %d\\n" % self.scheduler._process.pid)
        os.kill(os.getpid(), signal.SIGTERM)

    rq_worker.FleetWorker._start_scheduler = start_then_sigterm
    sys.exit(rq_worker.main(["--queues", "writeback", "--name", "rq-early"]))
""")

# ... and one whose SIGTERM arrives once RQ's handler is in, before its loop's ``try`` (RQ's
# handler raises StopRequested there, out of ``work()`` with no teardown: the scheduler process,
# never stopped, was then joined at exit for ever)
SIGTERM_BEFORE_THE_LOOP = textwrap.dedent("""
    import os, signal, sys
    from worker.rq import rq_worker

    base = rq_worker.FleetWorker._install_signal_handlers

    def install_then_sigterm(self):
        base(self)
        os.write(1, b"scheduler-pid %d\\n" % self.scheduler._process.pid)
        os.kill(os.getpid(), signal.SIGTERM)

    rq_worker.FleetWorker._install_signal_handlers = install_then_sigterm
    sys.exit(rq_worker.main(["--queues", "writeback", "--name", "rq-late"]))
""")


# ... and one whose scheduler process loses the worker's first SIGTERM. CPython clears the
# signals a child received before its fork hooks ran, and one that arrives between the hook and
# the scheduler's own handler finds no handler to run: in CI the scheduler started after the
# worker's teardown had signalled it, and RQ's join waited for ever. (The child here drops the
# first SIGTERM, then works as RQ's scheduler does.)
SCHEDULER_LOSES_THE_FIRST_SIGTERM = SIGTERM_BEFORE_RQ_HANDLERS.replace("rq-early", "rq-deaf").replace(
    "base = rq_worker", textwrap.dedent("""\
    import rq.scheduler

    work = rq.scheduler.RQScheduler.work

    def deaf_to_the_first_sigterm(self):
        dropped = []
        signal.signal(signal.SIGTERM, lambda signum, frame: dropped.append(signum))
        while not dropped:
            signal.pause()
        work(self)

    rq.scheduler.RQScheduler.work = deaf_to_the_first_sigterm
    base = rq_worker"""), 1)


@pytest.mark.parametrize("script", [SIGTERM_BEFORE_RQ_HANDLERS, SIGTERM_BEFORE_THE_LOOP,
                                    SCHEDULER_LOSES_THE_FIRST_SIGTERM],
                         ids=["before-rqs-handler", "before-rqs-loop", "scheduler-loses-a-sigterm"])
def test_a_sigterm_while_rq_starts_stops_the_worker_cleanly(script: str, fleet_env: dict[str, str],
                                                             r: redis.Redis, tmp_path: Path) -> None:
    ended = run_worker_script(script, fleet_env, tmp_path / "rq.log")
    assert ended.code == 0, ended.text
    assert [w.name for w in rqjobs.workers(r, QUEUE)] == []  # it deregistered
    assert not ended.scheduler_left, "its scheduler outlived it"
    assert not r.exists(f"rq:scheduler-lock:{QUEUE}")  # and let go of the queue's lock


# ... and one whose SIGTERM arrives while it starts, before it registered with RQ
SIGTERM_BEFORE_REGISTERING = textwrap.dedent("""
    import os, signal, sys
    from worker.rq import rq_worker

    hold = rq_worker.hold_stop_signals

    def hold_then_sigterm():
        hold()
        os.kill(os.getpid(), signal.SIGTERM)

    rq_worker.hold_stop_signals = hold_then_sigterm
    sys.exit(rq_worker.main(["--queues", "writeback", "--name", "rq-earlier"]))
""")


def test_a_sigterm_while_starting_exits_before_registering(fleet_env: dict[str, str], r: redis.Redis) -> None:
    done = subprocess.run([sys.executable, "-c", SIGTERM_BEFORE_REGISTERING], env=fleet_env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "exiting before registering" in done.stderr
    assert [w.name for w in rqjobs.workers(r, QUEUE)] == [] and not r.exists("rq:worker:rq-earlier")


# ... and one that fails while RQ starts, after its scheduler process was forked
FAILS_AFTER_THE_SCHEDULER_STARTED = textwrap.dedent("""
    import os, sys
    from worker.rq import rq_worker

    def fail(self):
        os.write(1, b"scheduler-pid %d\\n" % self.scheduler._process.pid)
        raise RuntimeError("a failure while RQ starts")

    rq_worker.FleetWorker._install_signal_handlers = fail
    sys.exit(rq_worker.main(["--queues", "writeback", "--name", "rq-failed"]))
""")


def test_a_worker_that_fails_while_starting_exits_and_stops_its_scheduler(
        fleet_env: dict[str, str], tmp_path: Path) -> None:
    # (RQ's teardown is skipped: the scheduler, not a daemon, was waited for at exit for ever)
    ended = run_worker_script(FAILS_AFTER_THE_SCHEDULER_STARTED, fleet_env, tmp_path / "rq.log")
    assert ended.code == 1 and "a failure while RQ starts" in ended.text, ended.text  # the error, as it is
    assert "its scheduler process outlived the worker's loop: stopping it" in ended.text
    assert not ended.scheduler_left


# the scheduler process is forked while the worker holds stop signals: the child must not hold
# them (a SIGTERM sent before it installs its own handler would be lost, and RQ joins it)
FORKED_CHILD_SIGNALS = textwrap.dedent("""
    import os, signal
    from worker.rq import rq_worker

    rq_worker.hold_stop_signals()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if all(signal.getsignal(s) == signal.SIG_DFL for s in rq_worker.STOP_SIGNALS) else 3)
    _, status = os.waitpid(pid, 0)
    held = signal.getsignal(signal.SIGTERM) is rq_worker.remember_stop
    print("child", os.waitstatus_to_exitcode(status), "parent holds", held)
""")


def test_a_child_forked_while_stop_signals_are_held_gets_the_default_ones(fleet_env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-c", FORKED_CHILD_SIGNALS], env=fleet_env, capture_output=True,
                          text=True, timeout=30)
    assert done.stdout.strip() == "child 0 parent holds True", done.stdout + done.stderr
