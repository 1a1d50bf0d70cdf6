"""miles reward components that need nothing beyond the core: sandbox scripts and reward files,
pytest pass fraction, math answer match, format and length terms."""
