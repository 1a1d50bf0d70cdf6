"""Packaged recipes: YAML data files, listed by ``miles recipes ls``; not code."""
