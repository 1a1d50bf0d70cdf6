"""Embedded-engine tests (tiny models built from configs; no downloads)."""
