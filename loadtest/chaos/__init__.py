"""The chaos soak: restarts, full disks, stalled uploads and tenants under traffic, with a
ledger of what was acknowledged (`make soak`)."""
