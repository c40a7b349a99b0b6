"""Pure planning: buckets of the wire image, and which sender owns which bytes."""
