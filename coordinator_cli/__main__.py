from coordinator_cli.app import main

main()
