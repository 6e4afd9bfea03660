"""Observation: goodput and cost accounting, Prometheus metrics, reports."""
