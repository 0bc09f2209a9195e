"""Where a text datamodule's rows come from: the token store, a stream, or a weighted mixture."""
