"""What the Hydra recipes share: config schemas, data, the training entry point and the launcher."""
