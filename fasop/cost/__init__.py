"""The cost model of one plan: parameters and memory, compute, communication, the pipeline schedule and the
step time they add up to (docs/cost-model.md has every formula)."""
