"""miles sandbox plugin: Daytona cloud sandboxes."""
