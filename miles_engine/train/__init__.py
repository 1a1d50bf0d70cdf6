"""Training: recipes, the driver loop, the SFT warm start and the pieces the tiny CPU recipe builds."""
