"""The `orchestrator` command's subcommands by subject; `orchestrator.user.cli` puts them in one group."""
