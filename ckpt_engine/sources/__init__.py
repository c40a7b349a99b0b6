"""Weight sources: what a trainer hands to a sync (metadata first, tensors lazily)."""
