"""Node daemons: asyncio processes that wire the channels and the RL layer (see nodes/*.py)."""
