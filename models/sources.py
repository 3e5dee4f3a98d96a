"""Where a pool's checkpoint is on this node: its path, a packaged model's file, or a demo checkpoint
(written here on first use).

The config only names a model (`config/pools.py`); this module finds it, so the config stays
a leaf. The layers that start pools use it: `raylane serve` (which writes the demo checkpoints up
front, with a progress bar) and the app builder, which hands `prepare_engine_config` to each
`ModelPool` replica: a replica may run on a node that has never seen the demo checkpoint.
"""

import os

from raylane.config import ClusterConfig, EngineConfig, PoolConfig
from raylane.models.demo import create_demo_models, default_demo_dir
from raylane.models.packaged import packaged_model_path


def model_path(pool: PoolConfig) -> str:
    """The pool's checkpoint on this node (demo models live in `default_demo_dir()`, packaged ones in
    their package); `PackagedModelMissing` when a packaged model is not installed."""
    if pool.sim_profile is not None:  # a simulated engine: no checkpoint (its tokenizer is its profile's)
        return pool.model
    if pool.demo_model is not None:
        return str(default_demo_dir() / pool.demo_model)
    if pool.packaged_model is not None:
        return str(packaged_model_path(pool.packaged_model))
    return pool.engine_config().model


def engine_config(pool: PoolConfig) -> EngineConfig:
    """The pool's engine config with the checkpoint path resolved on this node."""
    return pool.engine_config(model_path(pool))


def prepare_engine_config(pool: PoolConfig) -> EngineConfig:
    """`engine_config`, after writing the pool's demo checkpoint if this node has none yet."""
    if pool.demo_model is not None:
        create_demo_models(default_demo_dir(), names=[pool.demo_model])
    return engine_config(pool)


def missing_checkpoints(config: ClusterConfig) -> list[str]:
    """Pools whose checkpoint is not on this machine, each naming its field (every replica would
    fail and retry): what `raylane serve` and `raylane apply` check before deploying."""
    from raylane.models.gguf import is_gguf
    from raylane.models.packaged import PackagedModelMissing

    missing = []
    for i, p in enumerate(config.pools):
        if p.sim_profile is not None:
            continue
        where = f"pools[{i}] ({p.name}).model"
        try:
            path = model_path(p)
        except PackagedModelMissing as e:
            missing.append(f"{where}: {e}")
            continue
        if p.demo_model is None and not is_gguf(path) and not os.path.isfile(f"{path}/config.json"):
            missing.append(f"{where}: no checkpoint at {path} (config.json missing, not a .gguf file)")
    return missing
