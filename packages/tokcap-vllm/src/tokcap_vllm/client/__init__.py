"""client room (its door comes next)."""
