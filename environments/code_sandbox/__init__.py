"""Code-in-a-sandbox environment (a later issue)."""
