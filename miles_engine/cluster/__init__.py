"""Placement past one machine: ``placement.backend=ray`` puts engines and trainer ranks in Ray actors."""
