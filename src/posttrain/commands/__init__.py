"""One module per ``posttrain`` subcommand; each has ``run(args) -> int``. Argument handling only:
the work is done by the packages below."""
