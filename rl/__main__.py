from rl.cli import main

main()
