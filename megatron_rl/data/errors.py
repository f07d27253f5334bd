"""The data layer's error: a dataset row or file that cannot be read, named where it is."""


class DatasetError(ValueError):
    """A dataset row or file is malformed; the message names file, row and field."""
