"""Keras Models whose `train_step` trains something."""
