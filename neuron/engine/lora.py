"""LoRA adapters on the leader: which are registered, and which of the ranks' pool slots holds each.

Registering an adapter checks its PEFT folder against the base model (models/lora.py) before any
rank sees it, so a bad adapter is refused by name and nothing loaded is touched. The ranks hold
`max_loras` adapters at once; the others wait in host memory. When the scheduler admits a
request for an adapter that holds no slot, `acquire` gives it a free slot or the least recently
used one that no running request needs, and queues the load for the engine to send before the
step runs (the scheduler never talks to the ranks). A request whose adapter finds no such slot
stays waiting. Each loading of an adapter gets a number of its own (`lora_id`): the ranks' host
copies, and the prefix cache's keys, tell a reloaded adapter from its old self.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from neuron.errors import ConfigError
from neuron.models import text_config
from neuron.models.lora import LoraError, PeftAdapter


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """An adapter for a request, as vLLM's offline API names it: a name, a positive integer id,
    and its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest: lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be a positive integer, got {self.lora_int_id!r}")


@dataclass(slots=True, eq=False)
class Adapter:
    """A registered adapter: its name, folder, rank and this loading's number."""

    name: str
    path: str
    rank: int
    lora_id: int
    int_id: int | None = None  # the offline API's LoRARequest.lora_int_id
    resting: bool = False  # its weights left the ranks (`LoraSlots.rest`) and no request has loaded them since

    def cache_key(self, salt: bytes | None) -> bytes:
        """What the adapter's requests start their prefix-cache hash chains from: its loading's number
        beside the request's cache salt, so two adapters (or two loadings of one) never share blocks."""
        return hashlib.sha256(b"neuron lora\0" + self.lora_id.to_bytes(8, "little") + (salt or b"")).digest()


_IDS = itertools.count(1)  # lora ids unique in the process: a host's models never confuse two loadings


class LoraSlots:
    """The adapters an engine serves and the ranks' pool of `max_loras` slots."""

    def __init__(self, max_loras: int, max_rank: int, base_config: dict):
        self.max_rank = max_rank
        self.base_config = text_config(base_config)
        self.adapters: dict[str, Adapter] = {}
        self.holder: list[Adapter | None] = [None] * max_loras  # the adapter each slot holds
        self.users = [0] * max_loras  # running sequences using each slot
        self.recent: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))  # LRU first
        self.loads: list[tuple[int, Adapter]] = []  # slots to fill before the next step runs
        self.forgets: list[Adapter] = []  # removed adapters the ranks still hold
        self.rests: list[Adapter] = []  # served adapters whose weights the ranks are to drop while idle

    # ---- registry (the engine's caller) ----

    def register(self, name: str, path: str, int_id: int | None = None) -> Adapter:
        """Check the adapter at `path` against the base model and serve it as `name`. Raises LoraError
        (naming the cause) for an adapter neuron cannot apply, or a name already taken."""
        if name in self.adapters:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
        checked = PeftAdapter.open(path, self.base_config, self.max_rank)
        adapter = Adapter(name, str(path), checked.rank, next(_IDS), int_id)
        self.adapters[name] = adapter
        return adapter

    def resolve(self, request: LoRARequest) -> Adapter:
        """The adapter a LoRARequest names, registered the first time it is seen."""
        known = self.adapters.get(request.lora_name)
        if known is None:
            return self.register(request.lora_name, request.lora_path, request.lora_int_id)
        if known.int_id != request.lora_int_id or known.path != str(request.lora_path):
            raise ConfigError(f"LoRA adapter {request.lora_name!r} is loaded with id {known.int_id} from "
                              f"{known.path}; a request names it with id {request.lora_int_id} from "
                              f"{request.lora_path}")
        return known

    def remove(self, name: str) -> Adapter:
        """Stop serving adapter `name` (any thread): new requests for it are refused at once, its
        waiting ones get no slot, and the ranks forget it once no running sequence uses it (`fill`)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded")
        self.forgets.append(adapter)
        return adapter

    def rest(self, name: str) -> None:
        """Adapter `name` stays served, but the ranks drop its weights (its slots and host memory)
        at the next step if no sequence uses it then; its next request loads them again from its
        folder, as a first one does (any thread). An adapter in use by then keeps them."""
        adapter = self.adapters.get(name)
        if adapter is not None and adapter not in self.rests:
            self.rests.append(adapter)

    # ---- slots (the scheduler) ----

    def acquire(self, seq) -> bool:
        """A slot holding the adapter of `seq` (a Sequence: its `lora`; its `lora_slot` is set here),
        loading it into a free or the least recently used idle slot if needed; False when every slot
        is busy with other adapters, or the adapter was unloaded."""
        adapter = seq.lora
        if self.adapters.get(adapter.name) is not adapter:
            return False  # unloaded: the request is being aborted
        slot = next((i for i, held in enumerate(self.holder) if held is adapter), None)
        if slot is None:
            slot = next((i for i in self.recent if self.holder[i] is None), None)
            if slot is None:
                slot = next((i for i in self.recent if not self.users[i]), None)
            if slot is None:
                return False
            self.holder[slot] = adapter
            self.loads.append((slot, adapter))
            adapter.resting = False
        self.users[slot] += 1
        self.recent.move_to_end(slot)
        seq.lora_slot = slot
        return True

    def release(self, seq) -> None:
        slot = seq.lora_slot
        if slot is None:
            return
        seq.lora_slot = None
        self.users[slot] -= 1

    def forget(self, executor) -> None:
        """Tell the ranks to drop the removed adapters no running sequence reads any more, and the
        weights of the resting ones none uses (the engine, at the start of a step)."""
        while self.rests:  # popped one at a time: `rest` may append from another thread meanwhile
            adapter = self.rests.pop(0)
            slots = [i for i, held in enumerate(self.holder) if held is adapter]
            if self.adapters.get(adapter.name) is not adapter or any(self.users[i] for i in slots):
                continue  # removed (forgotten below), or in use again: it stays
            executor.forget_lora(adapter.lora_id)
            adapter.resting = True
            adapter.lora_id = next(_IDS)  # back from its folder as a new loading (its prefix-cache keys too)
            for i in slots:
                self.holder[i] = None
        for adapter in list(self.forgets):
            slots = [i for i, held in enumerate(self.holder) if held is adapter]
            if any(self.users[i] for i in slots):
                continue  # running sequences still read it: forgotten once they end
            executor.forget_lora(adapter.lora_id)
            self.forgets.remove(adapter)
            for i in slots:
                self.holder[i] = None

    def fill(self, executor) -> None:
        """Send the queued loads to the ranks (the engine, before the step that needs them). When the
        ranks cannot load one (its files changed since it was checked) the error goes up and the
        step's requests end with it; the slots not filled hold nothing, so a later request loads anew."""
        loads, self.loads = [(slot, a) for slot, a in self.loads if self.holder[slot] is a], []
        for i, (slot, adapter) in enumerate(loads):
            try:
                executor.load_lora(slot, adapter.lora_id, adapter.path)
            except Exception:
                for unfilled, _ in loads[i:]:
                    self.holder[unfilled] = None
                raise

    def reset(self) -> None:
        """The ranks were rebuilt (nothing runs): their pools and host copies are empty."""
        assert not any(self.users), "adapter slots are emptied only while no sequence runs"
        self.holder = [None] * len(self.holder)
        self.loads, self.forgets = [], []

    def resident(self) -> list[str]:
        return [a.name for a in self.holder if a is not None]

