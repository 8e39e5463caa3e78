"""Trained block drafter (DFlash-style): data, model, losses, training, floor, trees, serving.

Its commands (``distill-data``, ``train-drafter``, ``accel-drafter``, ``floor``,
``tree-study``) are ``specmesh.cli.blockdraft``."""
