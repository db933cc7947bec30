"""Golden vectors: the exact bytes of each wire format (``vectors.py`` makes them, ``test_golden.py`` checks them)."""
