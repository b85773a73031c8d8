"""Tools around the library: the ``tiered-kv`` command line, operator commands, archive, demo workload."""
