"""A leader process that loads hostile model files one after another (tests/test_hostile_files.py).

Reads one case per line on stdin (JSON: model, overrides, tp, extra), loads it through the offline
API and prints one JSON line per case: the error's type and message, or that it loaded, the
seconds it took and the process's peak RSS so far. Anything but a NeuronError is reported with its
traceback, for the test to show."""

import json
import resource
import sys
import time
import traceback

from neuron import LLM
from neuron.errors import NeuronError


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
        outcome.update(name=case["name"], elapsed=time.monotonic() - t0,
                       maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
