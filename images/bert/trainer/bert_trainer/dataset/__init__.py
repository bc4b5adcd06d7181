"""BERT pre-training data: Wikipedia or plain text -> sentence shards -> HDF5 instances."""
