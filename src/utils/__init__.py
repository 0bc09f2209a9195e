"""The ground floor every layer may use: errors, atomic file writes, the shared contracts."""
