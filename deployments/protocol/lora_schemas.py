"""vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` bodies, with raylane's `pool`: which
pool serves the adapter (also written `<pool>:<name>` as the name), needed only when several pools
serve adapters. Unknown fields are refused, as in every raylane endpoint."""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from raylane.deployments.protocol.openai_schemas import _Request

NAME = r"^([a-z0-9][a-z0-9_-]{0,62}:)?[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # as pools[].adapters names


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(pattern=NAME, description="the adapter's served name (`model` in requests)")
    lora_path: str = Field(
        min_length=1,
        max_length=4096,
        description="its PEFT directory (adapter_config.json + adapter_model.safetensors), absolute, on "
        "every node of the pool",
    )
    pool: str | None = Field(None, max_length=63, description="the pool to serve it on")
    load_inplace: bool = Field(
        False,
        description="replace an adapter loaded at run time under this name (its requests from now on "
        "run the new weights); else a name taken is a 400",
    )

    @field_validator("lora_path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not os.path.isabs(path):  # replicas run in other working directories
            raise ValueError("lora_path must be an absolute path")
        return path


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(pattern=NAME)
    lora_int_id: int | None = Field(None, description="accepted for vLLM's clients; the name decides")
    pool: str | None = Field(None, max_length=63)
