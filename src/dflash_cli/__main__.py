from dflash_cli.ui.cli import main

main()
