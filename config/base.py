"""The one base class of every config model."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section: an unknown key is an error (a typo must not be ignored silently), and a loaded
    config is read-only (what the Serve app, the manifests and the CLI were built from cannot drift;
    `model_copy(update=...)` makes a changed copy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
