"""gate room (its door comes next)."""
