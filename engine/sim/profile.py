"""A simulated engine's hardware profile: what the replica stands for (model, GPU, serving engine), its
KV capacity and batch limits, and the timing model a step takes its time from.

One step's time, in seconds (the linear model vLLM-style steps follow closely on one GPU: a fixed cost
that is mostly reading the weights, a cost per sequence, prefill proportional to the prompt tokens
computed, decode attention proportional to the KV read):

    base_s + per_seq_s * sequences + per_prefill_token_s * prefill tokens
           + per_context_token_s * context tokens of the decoding sequences

A sequence decodes in a step when it computes one token past everything it has (its next output token);
every other scheduled token (a prompt chunk, a preempted request's recompute) is a prefill token. Each
profile file cites where its coefficients come from (`source`).
"""

from dataclasses import dataclass
from pathlib import Path

import yaml

from raylane.config.model_names import SIM_PROFILES

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True, slots=True)
class StepTiming:
    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_context_token_s: float

    def step_time(self, sequences: int, prefill_tokens: int, context_tokens: int) -> float:
        """Seconds of one step of `sequences` requests, `prefill_tokens` of them prompt (or recompute)
        tokens, the decoding ones reading `context_tokens` of KV; 0 for an empty step."""
        if sequences == 0:
            return 0.0
        return (
            self.base_s
            + self.per_seq_s * sequences
            + self.per_prefill_token_s * prefill_tokens
            + self.per_context_token_s * context_tokens
        )


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    model: str  # the model it stands for (what /v1/models may name)
    hardware: str
    tokenizer: str  # the stand-in tokenizer: a packaged model's name, a directory or a .gguf file
    source: str
    max_model_len: int
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    timing: StepTiming
    natural_output_tokens: tuple[int, int]  # (min, max) length of an answer nothing else stops

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "HardwareProfile":
        try:
            shape, engine, timing = data["model_shape"], data["engine"], data["timing"]
            natural = data.get("natural_output_tokens", {"min": 16, "max": 512})
            profile = cls(
                name=str(data["name"]),
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                tokenizer=str(data["tokenizer"]),
                source=str(data["source"]),
                max_model_len=int(shape["max_model_len"]),
                kv_bytes_per_token=int(shape["kv_bytes_per_token"]),
                block_size=int(engine["block_size"]),
                num_kv_blocks=int(engine["num_kv_blocks"]),
                max_num_seqs=int(engine["max_num_seqs"]),
                max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
                timing=StepTiming(**{k: float(v) for k, v in timing.items()}),
                natural_output_tokens=(int(natural["min"]), int(natural["max"])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"sim_profile: {where} is not a hardware profile: {e!r}") from None
        if not 1 <= profile.natural_output_tokens[0] <= profile.natural_output_tokens[1]:
            raise ValueError(f"sim_profile: {where}: natural_output_tokens needs 1 <= min <= max")
        return profile


def profile_path(name_or_path: str) -> Path:
    """The YAML file of a shipped profile's name, or the path given."""
    if name_or_path in SIM_PROFILES:
        return PROFILE_DIR / f"{name_or_path}.yaml"
    return Path(name_or_path).expanduser()


def load_profile(name_or_path: str) -> HardwareProfile:
    path = profile_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"sim_profile: cannot read {path}: {e.strerror}") from None
    return HardwareProfile.from_dict(data if isinstance(data, dict) else {}, str(path))
