"""Tests against the real embedded SeaweedFS, node and CLI processes, ``pulsenet up``, torchrun and vLLM."""
