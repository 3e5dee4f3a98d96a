"""LoRA requests and the engine's adapter slots (the weights themselves: parallel/lora.py).

A request names its adapter with vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`. The
engine holds at most `max_loras` adapters at once, each in a slot of every adapted layer. A slot
is pinned while a running request uses it; when a waiting request needs an adapter that is not
resident, the scheduler gives it the least recently used unpinned slot, and the step that first
runs it carries the load (`ModelInput.lora_loads`: the weights the engine read and checked when the
adapter was first asked for), so every tensor-parallel rank loads its shard before the forward. A
request whose adapter finds every slot pinned waits.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's name and fields: the adapter's name, an id unique per adapter, its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be at least 1, got {self.lora_int_id}")


def adapter_id(name: str, path: str) -> int:
    """A `lora_int_id` for the adapter `name` at `path`, the same in every process (63 bits of a
    hash: two adapters sharing one is as likely as a collision of random 63-bit ids)."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**63 - 1) + 1


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slot: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._pins: dict[int, int] = {}  # adapter id -> running requests using it
        self._pending: list[tuple[int, int]] = []  # (slot, adapter id) to load before the next forward

    def slot_of(self, lora: LoRARequest | None) -> int:
        return -1 if lora is None else self._slot[lora.lora_int_id]

    def can_pin(self, lora: LoRARequest | None) -> bool:
        if lora is None or lora.lora_int_id in self._slot or len(self._slot) < self.max_loras:
            return True
        return any(not self._pins.get(i) for i in self._slot)

    def pin(self, lora: LoRARequest | None) -> None:
        """Mark `lora` in use by one more running request, placing it in a slot if needed
        (`can_pin` said one is free)."""
        if lora is None:
            return
        key = lora.lora_int_id
        if key not in self._slot:
            if len(self._slot) < self.max_loras:
                slot = len(self._slot)
            else:
                evicted = next(i for i in self._slot if not self._pins.get(i))
                slot = self._slot.pop(evicted)
            self._slot[key] = slot
            self._pending.append((slot, key))
        self._slot.move_to_end(key)
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, lora: LoRARequest | None) -> None:
        if lora is not None:
            self._pins[lora.lora_int_id] -= 1

    def take_loads(self) -> list[tuple[int, int]]:
        loads, self._pending = self._pending, []
        return loads

    def resident(self) -> list[int]:
        """Ids of the adapters in a slot, least recently used first."""
        return list(self._slot)
