"""miles sandbox plugin: E2B cloud sandboxes."""
