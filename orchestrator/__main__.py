from orchestrator.user.cli import main

main()
