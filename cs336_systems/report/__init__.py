"""Tables and plots built from result rows only (never typed numbers)."""
