"""The engine a config's `backend` names: the model's `LLMEngine`, or the `SimulatedEngine` (engine/sim/),
which imports no torch and no model code (so neither does this module until it is asked for one)."""

from raylane.config import EngineConfig


def make_engine(config: EngineConfig, placement_group=None):
    if config.simulated:
        from raylane.engine.sim.engine import SimulatedEngine

        return SimulatedEngine(config)
    from raylane.engine.llm_engine import LLMEngine

    return LLMEngine(config, placement_group)
