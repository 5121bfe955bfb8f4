"""Durable tiers below the host pool: the local file tier and the shared 3FS tier."""
