"""pulsenet: send only what changes the BF16 value used by the next forward pass."""

__version__ = "0.1.0"
