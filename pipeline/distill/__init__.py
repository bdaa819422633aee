"""Distillation from the donor: the teach stage that caches the donor's top-k over the train split
(the cache's format is `pipeline.data.teacher_cache`, which training reads too).
"""
