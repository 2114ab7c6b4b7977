"""One script per paper artifact; each row is a list of overrides of the training core (see common.py)."""
