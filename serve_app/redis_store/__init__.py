"""The Redis client, its key names and the scripts run in it: what every room that keeps state in Redis stands on."""
