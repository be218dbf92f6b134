"""Server-side strategies, one file per method, and the method registry."""
