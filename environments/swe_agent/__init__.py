"""SWE-agent style environment (a later issue)."""
