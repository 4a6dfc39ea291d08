"""Which LoRA adapter a request runs with, as vLLM's ``LoRARequest``: a name, a positive integer id and the adapter
directory. It travels in ``SamplingParams.lora`` (None: the bare base model), so every layer that carries a
request carries its adapter: the engine pipe, the scheduler (``--max-loras`` distinct adapters in the running
batch), the prefix cache (``prefix_root``: an adapter's KV is never another's) and the runner."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from hashlib import sha256


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and path (vLLM's field names). Two requests share an adapter when all three match."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora: lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora: lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora: lora_path must name the adapter's directory")


def _framed(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value


def prefix_root(root: bytes, lora: LoRARequest | None) -> bytes:
    """The parent key of a request's first prefix-cache block: ``root`` for the base model, else a key of
    (``root``, the adapter's name, id and path), each framed by tag and length, so no adapter's blocks ever match
    another's or the base model's (core.block_pool.hash_block)."""
    if lora is None:
        return root
    return sha256(root + _framed(b"lora-name", lora.lora_name.encode()) +
                  _framed(b"lora-id", struct.pack("<q", lora.lora_int_id)) +
                  _framed(b"lora-path", lora.lora_path.encode())).digest()
