"""The fuzz harness, its targets (``targets_*.py``) and their pytest entry (``test_fuzz.py``)."""
