class TrainingError(RuntimeError):
    """A run cannot go on (a non-finite loss, a run folder in use): the message names why and what to do."""
