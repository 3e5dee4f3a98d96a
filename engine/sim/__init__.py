"""The simulated engine (`engine.backend: simulated`, `model: sim:<profile>`): raylane's own scheduler,
KV block manager, prefix cache, preemption, priorities, tenants' shares, LoRA slots and output path,
with the model's forward replaced by a timing model read from a hardware profile (`profiles/*.yaml`).

- `profile.py`: `HardwareProfile`, its YAML and its step-time formula.
- `clock.py`: `RealClock` (a step sleeps its simulated time, the GIL released) and `VirtualClock` (time
  advances by the formula alone: tests and what-if runs take no wall-clock time).
- `tokens.py`: the tokens a simulated request generates, deterministic from its prompt.
- `tokenizer.py`: the stand-in tokenizer, loaded without torch.
- `engine.py`: `SimulatedEngine`.

Nothing here imports torch or model code, so a simulated replica costs a serving process and its
tokenizer, not a model's memory.
"""
