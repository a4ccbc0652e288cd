"""The run directory's format in one place: file names, the writer, the readers, the claim."""
