"""One module per `swarm` subcommand: add_parser(subparsers) and run(args)."""
