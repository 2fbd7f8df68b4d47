"""Training on one device: the reference trainer every plan must reproduce, its tiled form,
held-out evaluation, checkpoints and the progress line."""
