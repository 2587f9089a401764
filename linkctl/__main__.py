from linkctl.cli import main

main()
