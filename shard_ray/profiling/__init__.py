"""Measurement: fused shards on profiling actors, whole plans on a device gang, one store."""
