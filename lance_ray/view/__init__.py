"""The torch-facing edge: StreamingDataset, StreamingDataLoader and their statistics."""
