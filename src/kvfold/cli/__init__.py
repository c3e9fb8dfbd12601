"""The ``kvfold`` command line: every subcommand, the demo and chat."""
