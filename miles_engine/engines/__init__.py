"""Rollout engines: one protocol, an embedded PyTorch engine and an SGLang HTTP client."""
