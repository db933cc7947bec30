"""pulsenet's tests: unit/ (in-process, no servers), integration/ (SeaweedFS, node processes,
``pulsenet up``, torchrun, vLLM), fuzz/ (decoders fuzzed), golden/ (wire-format vectors), support/ (helpers).

A package so that every test imports its helpers one way, ``from tests.support.x import ...``, under
pytest-xdist and from any folder (pytest puts the repository root on ``sys.path``)."""
