"""Runs ab_script.py's target and initiator in two spawned processes
against one implementation ("real" or "ferry") and returns both logs."""

import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab_script  # noqa: E402


def run(impl: str, timeout: float = 120.0):
    ctx = mp.get_context("spawn")
    to_initiator, to_target = ctx.Queue(), ctx.Queue()
    t = ctx.Process(target=ab_script.target, args=(impl, to_target, to_initiator))
    i = ctx.Process(target=ab_script.initiator, args=(impl, to_initiator, to_target))
    t.start()
    i.start()
    t.join(timeout)
    i.join(timeout)
    for p in (t, i):
        if p.is_alive():
            p.kill()
            raise AssertionError(f"{impl}: a process of the A/B script did not finish (exit code {p.exitcode})")
    if t.exitcode or i.exitcode:
        raise AssertionError(f"{impl}: target exited {t.exitcode}, initiator {i.exitcode} (their stderr is above)")
    # What is left: the target's log (for the initiator) and the initiator's.
    target_log, initiator_log = to_initiator.get(timeout=5), to_target.get(timeout=5)
    return dict(target_log), dict(initiator_log)
