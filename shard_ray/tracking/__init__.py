"""Experiment tracking: every plan evaluation is an MLflow run."""
