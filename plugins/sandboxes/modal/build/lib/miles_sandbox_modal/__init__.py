"""miles sandbox plugin: Modal sandboxes."""
