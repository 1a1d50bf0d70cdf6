"""Agents (harnesses) drive a task's tools; model-free ones live here, the model-driven one in tito."""
