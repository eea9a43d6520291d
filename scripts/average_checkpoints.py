"""The path this command had before it joined the package: `python -m transformer.average` (or
`transformer-average`) is the command, with the same arguments."""

from transformer.average import main

if __name__ == "__main__":
    main()
