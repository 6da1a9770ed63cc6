"""Reading: read requests, sorted takes, the local and Ray Data readers, Arrow to tensors,
and transforms with their error policies."""
