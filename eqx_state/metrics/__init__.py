"""Metrics kept as state: mergeable sufficient statistics updated inside the step."""
