"""Typed recipe configuration: YAML with line numbers, dotted overrides, one error line per fault."""

from miles_engine.config.recipe import ComponentRef, RecipeConfig, load_recipe, resolve_recipe_path

__all__ = ["ComponentRef", "RecipeConfig", "load_recipe", "resolve_recipe_path"]
