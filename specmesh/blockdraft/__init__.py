"""Trained block drafter (DFlash-style): data, model, losses, training, floor, trees, serving."""
