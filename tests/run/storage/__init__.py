"""Studies shared by launches through a database server or a journal file."""
