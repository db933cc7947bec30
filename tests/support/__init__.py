"""Helpers shared by tests: fixtures' building blocks, tiny model dirs, and scripts the tests run as
processes (``loco_worker.py``, ``status_worker.py``, ``frozen_worker.py``, ``sync_subscriber.py``: they
import only pulsenet, so ``python tests/support/NAME.py`` works from any directory)."""
