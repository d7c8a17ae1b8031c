"""TextArena's text games as one environment family (`env.name=textarena`)."""
