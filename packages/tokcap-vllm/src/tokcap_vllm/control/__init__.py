"""control room (its door comes next)."""
