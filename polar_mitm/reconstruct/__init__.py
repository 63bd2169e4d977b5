"""Reconstruction: per-request records → training sequences (per_request, prefix_merging)."""
