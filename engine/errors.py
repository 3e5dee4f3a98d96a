"""The engine's own errors: the ones its callers catch by type.

Kept apart from the code that raises them so a caller (the pool deployment, a test) can name them
without importing the executor, Ray or torch. A bad prompt or parameter is not here: that is the
caller's `ValueError`, as in vLLM.
"""


class EngineDeadError(RuntimeError):
    """The engine failed (its step loop, its core process or a rank of its worker group); requests in
    flight end with this error instead of hanging, and `check_health()` raises it from then on."""


class InsufficientResourcesError(RuntimeError):
    """The cluster (or the placement group handed in) cannot hold the engine's ranks."""
