"""Distillation from the donor: the teach stage that caches the donor's top-k over the train split,
and the cache's format.
"""
