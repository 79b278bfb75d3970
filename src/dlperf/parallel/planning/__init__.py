"""Plans: what a training plan is, the search that chooses one by measuring, and the cache of decisions."""
