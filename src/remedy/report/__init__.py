"""`remedy report` and `remedy explain`: reading a run back for people."""
