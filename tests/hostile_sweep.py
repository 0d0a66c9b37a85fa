"""A leader process that loads hostile model files one after another (tests/test_hostile_files.py).

Reads one case per line on stdin (JSON: model, overrides, tp, extra), loads it through the offline
API and prints one JSON line per case: the error's type and message, or that it loaded, the
seconds it took and the process's peak RSS so far (VmHWM). Anything but a NeuronError is reported with its
traceback, for the test to show."""

import json
import sys
import time
import traceback

from neuron import LLM
from neuron.errors import NeuronError


def _peak_rss() -> int:
    """This process's peak resident bytes (VmHWM). Not getrusage's ru_maxrss, which Linux carries
    over from the parent a process was forked from (a test run of a gigabyte) across the exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    for line in sys.stdin:
        case = json.loads(line)
        print(json.dumps({"start": case["name"]}), flush=True)
        t0 = time.monotonic()
        outcome: dict = {}
        try:
            with LLM(model=case["model"], hf_overrides=case["overrides"], tensor_parallel_size=case["tp"],
                     **case["extra"]):
                outcome["loaded"] = True
        except NeuronError as exc:
            outcome.update(type=type(exc).__name__, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - reported, for the test to fail on
            outcome.update(type=type(exc).__name__, error=str(exc), traceback=traceback.format_exc())
        outcome.update(name=case["name"], elapsed=time.monotonic() - t0, maxrss=_peak_rss())
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
