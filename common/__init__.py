"""Shared pieces of the recipes: data, models, metrics, checkpoints, run plumbing."""
