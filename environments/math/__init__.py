"""Math environment (SDK issue)."""
