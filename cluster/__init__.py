"""Bringing clusters up with `ray up` (cluster.yaml for GPU clouds, cluster.local.yaml
for the local twin): what those files name that is code, like the local twin's
node provider (``local_provider``)."""
