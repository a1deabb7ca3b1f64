"""Gradient transforms (``seams.GradientTransform``): what a group's
unscaled gradients go through before the apply."""
