"""Rollout-engine tests."""
