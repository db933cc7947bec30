"""Model presets: the [trainer] and [inference] settings a model starts from in `pulsenet up` and `bench rl` (nodes/plan.py)."""
