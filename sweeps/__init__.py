"""Hyper-parameter sweeps over the training core. ``python -m sweeps.aqn``: the Optuna study of AQN's noise schedule."""
