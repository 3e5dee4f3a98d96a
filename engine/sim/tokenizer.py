"""The simulated engine's stand-in tokenizer, loaded without torch.

`transformers.AutoTokenizer` imports torch (about 200 MB a process); `PreTrainedTokenizerFast` reads the
same `tokenizer.json` without it. A GGUF file's tokenizer is read from its sidecar directory
(models/gguf_sidecar.py); a machine that has none yet writes it once in a child process, whose torch
import ends with it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from raylane.config import PACKAGED_MODELS
from raylane.models.gguf_sidecar import has_sidecar, is_gguf, sidecar_path
from raylane.models.packaged import packaged_model_path

WRITE_SIDECAR = "import sys; from raylane.models.gguf_sidecar import gguf_sidecar; gguf_sidecar(sys.argv[1])"


def tokenizer_dir(spec: str) -> Path:
    """The directory to read the tokenizer from: a packaged model's name, a .gguf file, or a directory."""
    path = packaged_model_path(spec) if spec in PACKAGED_MODELS else Path(spec).expanduser()
    if not is_gguf(path):
        return path
    if not has_sidecar(path):
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        subprocess.run([sys.executable, "-c", WRITE_SIDECAR, str(path)], check=True, env=env)
    return sidecar_path(path)


def load_sim_tokenizer(spec: str):
    from transformers import PreTrainedTokenizerFast

    directory = tokenizer_dir(spec)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(
            f"tokenizer: no tokenizer.json in {directory} (the simulated engine needs a fast one)"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def eos_ids_of(spec: str, tokenizer) -> frozenset[int]:
    """The generation config's EOS ids (one or a list) and the tokenizer's own."""
    ids = set()
    config = tokenizer_dir(spec) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
