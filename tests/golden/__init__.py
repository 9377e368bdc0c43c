"""Pinned identities and numbers: run_keys.json (`tests/test_identity.py`), numbers.json (`tests/golden/regen.py`)."""
