"""offspec/cli: the `offspec` command: its sub-commands and their option parsing."""
