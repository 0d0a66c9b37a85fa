"""The step watchdog: one thread for every step's deadline."""

from __future__ import annotations

import threading
import time

from neuron.executor.watchdog import StepWatchdog


def test_a_step_past_its_deadline_fires_once_and_names_that_step():
    calls = []
    dog = StepWatchdog(lambda: calls.append(time.monotonic()))
    try:
        first = dog.arm(0.05)
        time.sleep(0.3)
        assert len(calls) == 1 and dog.fired(first)
        second = dog.arm(5.0)
        assert not dog.fired(second)
        dog.disarm()
    finally:
        dog.stop()


def test_steps_that_end_in_time_never_fire_and_share_one_thread():
    calls = []
    dog = StepWatchdog(lambda: calls.append(1))
    before = threading.active_count()
    try:
        for _ in range(200):
            token = dog.arm(0.2)
            dog.disarm()
        assert threading.active_count() == before + 1
        short = dog.arm(0.05)  # a shorter deadline than the one the thread sleeps towards wakes it
        time.sleep(0.3)
        assert calls == [1] and dog.fired(short) and not dog.fired(token)
    finally:
        dog.stop()
    assert threading.active_count() == before


def test_arming_after_stop_starts_a_new_thread():
    calls = []
    dog = StepWatchdog(lambda: calls.append(1))
    dog.arm(10.0)
    dog.stop()
    try:
        dog.arm(0.05)
        time.sleep(0.3)
        assert calls == [1]
    finally:
        dog.stop()
