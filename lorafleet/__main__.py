from lorafleet.cli import main

main()
