"""Flax NNX models that touch the paged cache only through decodejax interfaces."""
