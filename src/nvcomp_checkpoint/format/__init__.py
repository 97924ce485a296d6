"""The checkpoint file format: byte layout and the serialized non-tensor tree."""
