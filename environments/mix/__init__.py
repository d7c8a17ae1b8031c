"""Several environments as one (`env.name=mix`): a run that trains on a mixture of families."""
