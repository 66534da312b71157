"""The churn experiment: may a set of approved adapters share a pool? A manifest in, a
decision with its evidence out."""
