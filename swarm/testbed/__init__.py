"""A cluster on one machine for tests and experiments: namespaces, cgroups and tc, or loopback ports."""
