"""Compute kernels (Triton) and their pure-torch references. Never imports flame.models."""
