"""The red team: attacks a hostile local user can make, each against its own sidecar
(`python -m loadtest.redteam.runner`), and the hostile inputs tests force the same way."""
