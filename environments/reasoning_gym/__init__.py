"""reasoning-gym's procedural datasets as one environment family (`env.name=reasoning-gym`)."""
