"""server room (its door comes next)."""
