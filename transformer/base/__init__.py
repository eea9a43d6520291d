"""What every part of the package may import, importing nothing of the package itself: the config type check and
the one-line form of an error."""
