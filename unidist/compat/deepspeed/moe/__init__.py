"""TEMPORARY minimal stand-in (the lead's bootstrap); helper DIST's moe replaces it."""
