"""Lightning callbacks of the template."""
